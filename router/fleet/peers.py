"""The router's own replicas as pods (``replicas.discovery``): a LIST of the pods carrying the
router's labels, through the API access of worker discovery (:mod:`router.fleet.discovery`,
the ``k8s`` extra; the Role that lets the router watch its workers' pods covers its own).
Replica sync subscribes to every running one (``tcp://<podIP>:<sync port>``; its own messages
are told apart by origin), and a starting replica warm-starts from a ready one's index
(``http://<podIP>:<port>``). A LIST every ``interval_s`` is enough: peers come and go at the pace
of rollouts, and sync never waits for one."""

from __future__ import annotations

from typing import Any, NamedTuple

from router.fleet.discovery import KubernetesDiscovery
from router.fleet.pods import pod_ready
from router.settings import PeerDiscoverySettings

__all__ = ["PeerPod", "RouterPods"]


class PeerPod(NamedTuple):
    name: str
    ip: str
    ready: bool


class RouterPods:
    """Lists the router's pods; built at start (a missing client library or API configuration
    fails the start with :class:`router.errors.ConfigError`)."""

    def __init__(self, settings: PeerDiscoverySettings) -> None:
        self.settings = settings
        self._k8s = KubernetesDiscovery(settings.as_discovery())

    async def list(self) -> list[PeerPod]:
        """Running pods with an IP (``ready``: their Ready condition too); raises what the
        Kubernetes client raises when the API server cannot be read."""
        from lightkube.resources.core_v1 import Pod

        s = self.settings
        client: Any = self._k8s.client()
        try:
            pods = [p async for p in client.list(Pod, namespace=s.namespace, labels=s.labels)]
        finally:
            await client.close()
        out = []
        for p in pods:
            meta, status = p.metadata, p.status
            if meta is None or meta.deletionTimestamp is not None or status is None:
                continue
            if status.phase == "Running" and status.podIP:
                out.append(PeerPod(meta.name or "", status.podIP, pod_ready(p)))
        return out
