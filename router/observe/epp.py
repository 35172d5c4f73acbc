"""Metrics of the endpoint picker's gRPC door (:mod:`router.edge.epp`): the ext_proc streams open
now and the streams it turned away, by reason. Light families (:mod:`router.observe.family`) on
the router's registry, kept beside :class:`router.observe.metrics.RouterMetrics`, which owns one
:class:`EppMetrics`. (A stream's request is counted as every request is: proxied, rejected.)"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.observe.family import Family

__all__ = ["EppMetrics"]


class EppMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.streams = Family(
            "gauge",
            "kvrouter_epp_streams",
            "ext_proc streams open on the endpoint picker now (served, or being refused)",
            registry=r,
        )
        self.refused = Family(
            "counter",
            "kvrouter_epp_streams_refused",
            "ext_proc streams the endpoint picker turned away, by reason: max_streams (past "
            "epp.max_streams open: answered 429 once its headers came), overload (past 4 x "
            "epp.max_streams open: closed RESOURCE_EXHAUSTED before a read)",
            ["reason"],
            registry=r,
        )

    def open_now(self, n: int) -> None:
        self.streams.set(n)

    def refuse(self, reason: str) -> None:
        self.refused.labels(reason).inc()
