"""Metrics of replica sync (:mod:`router.runtime.replicas`), read at scrape time from the sync's
and the remote tickets' own counters, like :class:`router.observe.metrics.StateCollector`, so
nothing is counted twice and the placing path pays nothing for them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ReplicaCollector", "ReplicaStats"]


@dataclasses.dataclass
class ReplicaStats:
    """One scrape's worth of replica sync state."""

    origin: str  #: this process's origin id (random per start)
    process: str  #: its index under ``--processes`` ("0" alone)
    sent: int = 0
    received: int = 0
    gaps: int = 0
    peers: int = 0
    #: this replica's lane among the replicas it hears (0 alone)
    lane: int = 0
    remote_tickets: int = 0
    #: sync messages or events dropped, by reason
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    #: remote tickets ended, by reason
    ended: dict[str, int] = dataclasses.field(default_factory=dict)


class ReplicaCollector(Collector):
    def __init__(self, sample: Callable[[], ReplicaStats]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[Metric]:
        s = self._sample()
        info = GaugeMetricFamily(
            "kvrouter_replica_info",
            "1, labelled with this router process's sync origin id (random per start) and its "
            "index under server.processes",
            labels=["origin", "process"],
        )
        info.add_metric([s.origin, s.process], 1)
        yield info
        for name, doc, value in (
            ("sent", "replica sync messages published (heartbeats included)", s.sent),
            ("received", "replica sync messages from peers applied", s.received),
            ("gaps", "replica sync messages a peer published that never arrived", s.gaps),
        ):
            c = CounterMetricFamily(f"kvrouter_replica_sync_{name}", doc)
            c.add_metric([], value)
            yield c
        dropped = CounterMetricFamily(
            "kvrouter_replica_sync_dropped",
            "replica sync messages (or events in them) dropped, by reason",
            labels=["reason"],
        )
        for reason, n in sorted(s.dropped.items()):
            dropped.add_metric([reason], n)
        yield dropped
        ended = CounterMetricFamily(
            "kvrouter_replica_remote_tickets_ended",
            "peers' tickets ended here, by reason (ended by their owner, expired by TTL, evicted "
            "past replicas.max_remote_tickets, peer_lost, worker_removed)",
            labels=["reason"],
        )
        for reason, n in sorted(s.ended.items()):
            ended.add_metric([reason], n)
        yield ended
        for name, doc, v in (
            ("kvrouter_replica_remote_tickets", "peers' tickets live here", s.remote_tickets),
            ("kvrouter_replica_peers", "peer replicas heard within peer_timeout_s", s.peers),
            (
                "kvrouter_replica_lane",
                "this replica's lane among the replicas it hears: which of the near-best workers "
                "it takes first (scoring.replica_spread); 0 alone",
                s.lane,
            ),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], v)
            yield g
