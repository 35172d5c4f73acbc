"""Settings of router replicas that place as one (``replicas:``, docs/architecture.md §9): the
sync between replicas (:mod:`router.runtime.replicas`), how a replica finds its peers, and its
warm start from a peer's index; part of :class:`router.settings.Settings`, kept here so each
module stays small."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

import msgspec

from router.errors import config_check as _check
from router.settings.k8s import DiscoverySettings

__all__ = ["PeerDiscoverySettings", "ReplicaSettings"]

_ZMQ = ("tcp://", "ipc://", "inproc://")
_LOOPBACK = ("127.0.0.1", "::1", "localhost")
_TCP_PORT = re.compile(r"^tcp://.+:(\d{1,5})$")


class PeerDiscoverySettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Peers found by listing the router's own pods (the API access of ``kubernetes.discovery``:
    in a pod, its service account; elsewhere ``api_server`` or ``~/.kube/config``)."""

    enabled: bool = False
    namespace: str | None = None
    labels: dict[str, str] = msgspec.field(
        default_factory=lambda: {
            "app.kubernetes.io/name": "kvrouter",
            "app.kubernetes.io/component": "router",
        }
    )
    api_server: str | None = None
    interval_s: float = 10.0
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        # the label and URL rules of worker discovery, checked by its own Struct
        DiscoverySettings(labels=self.labels, api_server=self.api_server, timeout_s=self.timeout_s)
        _check(self.interval_s > 0, "interval_s", "must be > 0")

    def as_discovery(self) -> DiscoverySettings:
        """The same API access, as :class:`router.fleet.discovery.KubernetesDiscovery` takes."""
        return DiscoverySettings(
            enabled=True,
            namespace=self.namespace,
            labels=self.labels,
            api_server=self.api_server,
            timeout_s=self.timeout_s,
        )


class ReplicaSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``peer_key_file`` is the replicas' shared secret (a file: in Kubernetes a Secret): it
    authenticates and encrypts replica sync over TCP and is the credential a replica shows a
    peer's ``/admin/snapshot`` (:mod:`router.runtime.replicas.peerkey`), so the admin key never
    leaves the replica. Sync over TCP and warm starts need it, or ``trusted_network: true``
    (anyone who reaches the sync port then reads every placement and can steer them)."""

    sync_bind: str | None = None
    peers: list[str] = msgspec.field(default_factory=list)
    discovery: PeerDiscoverySettings = msgspec.field(default_factory=PeerDiscoverySettings)
    ticket_ttl_s: float = 120.0
    max_remote_tickets: int = 100_000
    max_hashes: int = 8192
    max_message_bytes: int = 1 << 18
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 5.0
    drain_budget_ms: float = 5.0
    drain_max_hashes: int = 32768
    max_peer_state_mib: float = 128.0
    max_remote_state_mib: float = 512.0
    max_queue_mib: float = 64.0
    warm_from: list[str] = msgspec.field(default_factory=list)
    warm_timeout_s: float = 10.0
    max_snapshot_bytes: int = 1 << 28
    peer_key_file: str | None = None
    trusted_network: bool = False

    def __post_init__(self) -> None:
        if self.sync_bind is not None:
            ok = self.sync_bind.startswith(_ZMQ)
            _check(ok, "sync_bind", "must be a ZMQ endpoint (tcp://0.0.0.0:5600, ipc://PATH)")
        if self.discovery.enabled:  # a peer's endpoint is its pod IP and this same port
            port = _TCP_PORT.search(self.sync_bind or "")
            ok = port is not None and 0 < int(port.group(1)) < 65536
            _check(ok, "sync_bind", "must be tcp://HOST:PORT (a fixed port) with discovery")
        for i, p in enumerate(self.peers):
            _check(p.startswith(_ZMQ), f"peers[{i}]", "must be a ZMQ endpoint (tcp://host:port)")
        for i, u in enumerate(self.warm_from):
            ok = u.startswith(("http://", "https://"))
            _check(ok, f"warm_from[{i}]", "must be a router's http(s) URL")
        _check(self.ticket_ttl_s > 0, "ticket_ttl_s", "must be > 0")
        _check(self.max_remote_tickets >= 1, "max_remote_tickets", "must be >= 1")
        _check(1 <= self.max_hashes <= 1 << 20, "max_hashes", "must be between 1 and 1048576")
        need = self.sent_message_bytes  # the receiving socket's cap lets the largest through
        _check(self.max_message_bytes >= need, "max_message_bytes", f"must be >= {need}")
        _check(self.heartbeat_s > 0, "heartbeat_s", "must be > 0")
        ok = self.peer_timeout_s > 2 * self.heartbeat_s
        _check(ok, "peer_timeout_s", "must be > 2 x heartbeat_s")
        _check(self.drain_budget_ms > 0, "drain_budget_ms", "must be > 0")
        _check(self.drain_max_hashes >= 1, "drain_max_hashes", "must be >= 1")
        # (a ticket larger than a budget is refused and counted: router.placement.remote)
        _check(self.max_peer_state_mib > 0, "max_peer_state_mib", "must be > 0")
        ok = self.max_remote_state_mib >= self.max_peer_state_mib
        _check(ok, "max_remote_state_mib", "must be >= max_peer_state_mib")
        ok = self.max_queue_mib * (1 << 20) >= self.max_message_bytes
        _check(ok, "max_queue_mib", "must hold one message of max_message_bytes")
        _check(self.warm_timeout_s > 0, "warm_timeout_s", "must be > 0")
        _check(self.max_snapshot_bytes >= 1024, "max_snapshot_bytes", "must be >= 1024")
        path = self.peer_key_file
        _check(path is None or os.path.isfile(path), "peer_key_file", "must be a readable file")
        ok = path is not None or self.trusted_network or not self.exposed
        _check(
            ok,
            "peer_key_file",
            "is needed for replica sync over TCP and warm starts (a shared secret in a file, e.g. "
            "`openssl rand -hex 32`), or trusted_network: true on a network you trust",
        )

    @property
    def sent_message_bytes(self) -> int:
        """The largest sync message a replica publishes: at most ~2 x ``max_hashes`` hashes (it
        sends once ``max_hashes`` are pending; 9 bytes each in msgpack, counted 10) and a few
        hundred small events."""
        return 20 * self.max_hashes + 65536

    @property
    def enabled(self) -> bool:
        """Whether this replica syncs at all (it publishes, subscribes, or both)."""
        return bool(self.sync_bind or self.peers or self.discovery.enabled)

    @property
    def exposed(self) -> bool:
        """Whether another host may reach this replica's sync or snapshot traffic: sync over TCP
        (``ipc://`` is a file, guarded by its directory: ``--processes``' siblings) or a warm
        start from a peer other than this host (``--processes``' restarted sibling warms from
        the shared port on loopback)."""
        eps = [self.sync_bind or "", *self.peers]
        remote = [u for u in self.warm_from if urlsplit(u).hostname not in _LOOPBACK]
        return self.discovery.enabled or bool(remote) or any(e.startswith("tcp://") for e in eps)
