"""Metrics of the closed loop (issue 36, :mod:`router.placement.loop`): the workers whose reported
cached tokens turned disagreeing with the index, by the shape of the disagreement (``reason``:
``index_ahead``, ``worker_ahead``; the log line names the likely cause), and those the loop scores
from their approximate tree now. Light families (:mod:`router.observe.family`) on the router's
registry, kept beside :class:`router.observe.metrics.RouterMetrics`, which owns one
:class:`AgreementMetrics` and drops a removed worker's series with its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.observe.family import Family

__all__ = ["AgreementMetrics"]


class AgreementMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.turns = Family(
            "counter",
            "kvrouter_agreement_disagreements_total",
            "times a worker's reported cached tokens turned disagreeing with the index's "
            "prediction, by reason: index_ahead (it predicts hits the worker never reports) or "
            "worker_ahead (the worker reports hits the index never predicted)",
            ["worker", "reason"],
            registry=r,
        )
        self.disagreeing = Family(
            "gauge",
            "kvrouter_agreement_disagreeing",
            "1 while the closed loop scores a worker from its approximate tree because its "
            "reports disagree with its events (reason as in "
            "kvrouter_agreement_disagreements_total), 0 once it is back on its events",
            ["worker", "reason"],
            registry=r,
        )

    @property
    def families(self) -> list[Family]:
        return [self.turns, self.disagreeing]

    def changed(self, worker: str, reason: str, disagrees: bool) -> None:
        if disagrees:
            self.turns.labels(worker, reason).inc()
        self.disagreeing.labels(worker, reason).set(1 if disagrees else 0)
