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
    #: messages whose seq was far from their origin's last (a reset, replayed or spoofed)
    resets: int = 0
    peers: int = 0
    #: peers dropped from a full table to make room for a new one
    peers_evicted: int = 0
    #: this replica's lane among the replicas it hears (0 alone)
    lane: int = 0
    remote_tickets: int = 0
    #: bytes the remote tickets count against replicas.max_remote_state_mib
    remote_state_bytes: int = 0
    #: sync messages or events dropped, by reason
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    #: remote tickets ended, by reason
    ended: dict[str, int] = dataclasses.field(default_factory=dict)
    #: sync handshakes (CURVE) that failed, by reason
    handshake_failed: dict[str, int] = dataclasses.field(default_factory=dict)


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
            (
                "resets",
                "replica sync messages whose seq was far from their origin's last: applied, and "
                "the origin judged from them on (a replayed stream or a spoofed origin)",
                s.resets,
            ),
            (
                "peers_evicted",
                "peers dropped from a full peer table (1024) to make room for a new origin: the "
                "one silent longest, its tickets ended",
                s.peers_evicted,
            ),
        ):
            c = CounterMetricFamily(f"kvrouter_replica_sync_{name}", doc)
            c.add_metric([], value)
            yield c
        for name, doc, counts in (
            (
                "kvrouter_replica_sync_dropped",
                "replica sync messages (or events in them) dropped, by reason",
                s.dropped,
            ),
            (
                "kvrouter_replica_remote_tickets_ended",
                "peers' tickets ended here, by reason (ended by their owner, expired by TTL, "
                "evicted past replicas.max_remote_tickets, over_budget past max_peer_state_mib "
                "or max_remote_state_mib, peer_lost, worker_removed)",
                s.ended,
            ),
            (
                "kvrouter_replica_sync_handshakes_failed",
                "replica sync connections refused at the CURVE handshake, by reason: auth (a "
                "subscriber's key is not the peer key), crypto (a peer holds another peer key), "
                "mechanism (one side has no peer key), other",
                s.handshake_failed,
            ),
        ):
            by_reason = CounterMetricFamily(name, doc, labels=["reason"])
            for reason, n in sorted(counts.items()):
                by_reason.add_metric([reason], n)
            yield by_reason
        for name, doc, v in (
            ("kvrouter_replica_remote_tickets", "peers' tickets live here", s.remote_tickets),
            (
                "kvrouter_replica_remote_state_bytes",
                "bytes peers' tickets count here against replicas.max_remote_state_mib (256 B a "
                "hash, 512 B a ticket: the worst case)",
                s.remote_state_bytes,
            ),
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
