"""The replicas' shared peer key (``replicas.peer_key_file``) and the credentials derived from it.

Every replica of one fleet (and its endpoint picker) reads the same secret from a file — in
Kubernetes a Secret mounted as a volume — and derives, never sends, what each door needs:

- replica sync's ZMQ CURVE key pair (:meth:`PeerKey.curve`): every replica has the same pair, so
  a subscriber knows the publisher's public key and the publisher lets in only subscribers that
  show it (the peers hold the secret); the traffic is encrypted;
- the bearer token a replica shows a peer's ``GET /admin/snapshot`` (:meth:`PeerKey.snapshot_token`):
  a peer can read the index, and the admin key never leaves the replica that holds it.

Each derivation is an HMAC-SHA256 of the secret under its own label, so one credential tells
nothing of another or of the secret. Without a key, sync over TCP and warm starts run only with
``replicas.trusted_network: true``, which :func:`peer_key` warns about at start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from pathlib import Path

import zmq
from zmq.utils import z85

from router.errors import ConfigError
from router.settings import ReplicaSettings

__all__ = ["MIN_SECRET_BYTES", "PeerKey", "peer_key"]

log = logging.getLogger("kvrouter.replicas")

#: a shorter secret is refused: `openssl rand -hex 32` gives 64
MIN_SECRET_BYTES = 16
_CURVE_LABEL = b"kvrouter replica sync curve v1"
_SNAPSHOT_LABEL = b"kvrouter snapshot v1"


@dataclasses.dataclass(frozen=True)
class PeerKey:
    secret: bytes = dataclasses.field(repr=False)

    @classmethod
    def read(cls, path: str) -> PeerKey:
        """The key in ``path`` (its content, stripped); :class:`ConfigError` naming the path and
        the reason, never the content."""
        try:
            data = Path(path).read_bytes().strip()
        except OSError as e:
            reason = e.strerror or type(e).__name__
            raise ConfigError(
                f"invalid config: replicas.peer_key_file: cannot read {path}: {reason}"
            ) from None
        if len(data) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"invalid config: replicas.peer_key_file: {path} holds {len(data)} bytes: the peer "
                f"key needs at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
            )
        return cls(data)

    def _derive(self, label: bytes) -> bytes:
        return hmac.new(self.secret, label, hashlib.sha256).digest()

    def curve(self) -> tuple[bytes, bytes]:
        """The replicas' CURVE key pair, ``(public, secret)`` in Z85 as pyzmq's socket options
        take them (any 32 bytes are a Curve25519 secret key)."""
        secret = z85.encode(self._derive(_CURVE_LABEL))
        return zmq.curve_public(secret), secret

    def snapshot_token(self) -> str:
        """The bearer token of a peer's ``GET /admin/snapshot``."""
        return self._derive(_SNAPSHOT_LABEL).hex()

    def allows(self, token: str) -> bool:
        """Whether ``token`` is this key's snapshot token (compared in constant time)."""
        return hmac.compare_digest(token.encode(), self.snapshot_token().encode())


def peer_key(settings: ReplicaSettings) -> PeerKey | None:
    """The configured peer key, read now; None without one (a warning when sync or warm starts
    then cross the network: ``trusted_network``)."""
    if settings.peer_key_file is not None:
        return PeerKey.read(settings.peer_key_file)
    if settings.exposed:  # (the settings allow it only with trusted_network)
        log.warning(
            "replicas.trusted_network: replica sync and snapshots run without authentication: "
            "anyone who reaches the sync port reads every placement and can steer them, and a "
            "warm start shows its peers the admin key; set replicas.peer_key_file on a network "
            "you do not trust"
        )
    return None
