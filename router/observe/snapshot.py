"""Metrics of the index snapshots a replica started from (docs/architecture.md §9), read at
scrape time from the subscriber's own counts (:mod:`indexer.subscriber.restored`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["SnapshotCollector"]


class SnapshotCollector(Collector):
    def __init__(self, drops: Callable[[], dict[str, int]]) -> None:
        self._drops = drops

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "kvrouter_snapshot_ranks_dropped",
            "ranks of a restored snapshot not kept as they were, by reason: unconfigured_rank "
            "(beyond its worker's dp_ranks), unverifiable (no replay endpoint, seq or ts to "
            "check it by: cleared), rebuilt (from the publisher's whole stream instead)",
            labels=["reason"],
        )
        counts = {"unconfigured_rank": 0, "unverifiable": 0, "rebuilt": 0, **self._drops()}
        for reason, n in sorted(counts.items()):
            c.add_metric([reason], n)
        yield c
