"""Settings of Kubernetes worker discovery (``kubernetes.discovery``, :mod:`router.fleet.discovery`);
part of :class:`router.settings.Settings`, kept here so each module stays small."""

from __future__ import annotations

import re

import msgspec

from router.errors import config_check as _check

__all__ = ["DiscoverySettings", "KubernetesSettings"]


_LABEL_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


class DiscoverySettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Workers found by watching pods (:mod:`router.fleet.discovery`)."""

    enabled: bool = False
    namespace: str | None = None
    labels: dict[str, str] = msgspec.field(
        default_factory=lambda: {"app.kubernetes.io/component": "kvrouter-worker"}
    )
    endpoints: str = "annotations"
    annotation_prefix: str = "kvrouter.io/"
    http_port: int = 8000
    events_port: int = 5557
    replay_port: int | None = 5558
    api_server: str | None = None
    retry_s: float = 2.0
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _check(bool(self.labels), "labels", "must name at least one label (the worker pods' own)")
        for k, v in self.labels.items():
            _check(bool(_LABEL_NAME.match(k)), f"labels.{k}", "is not a Kubernetes label name")
            _check(len(v) <= 63 and bool(_LABEL_VALUE.match(v)), f"labels.{k}", "bad label value")
        _check(
            self.endpoints in ("annotations", "kv_event_sources"),
            "endpoints",
            "must be 'annotations' or 'kv_event_sources'",
        )
        for k in ("http_port", "events_port", "replay_port"):
            port = getattr(self, k)
            if port is not None:
                _check(1 <= port <= 65535, k, "must be between 1 and 65535")
        if self.api_server is not None:
            ok = self.api_server.startswith(("http://", "https://"))
            _check(ok, "api_server", "must be an http(s) URL")
        _check(self.retry_s > 0, "retry_s", "must be > 0")
        _check(self.timeout_s > 0, "timeout_s", "must be > 0")


class KubernetesSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    discovery: DiscoverySettings = msgspec.field(default_factory=DiscoverySettings)
