"""Prometheus metrics of one router app, on its own ``CollectorRegistry`` (no global registry, so
several apps — tests, replicas in one process — never collide).

Request-path metrics are counters, gauges and histograms updated by the handlers. They are this
module's own light families, not ``prometheus_client``'s: everything here runs on the event loop,
so no lock is needed, and a histogram observation is a ``bisect`` and two adds (~0.2 µs, against
~1.5 µs, several times that on cold caches, for ``prometheus_client``'s locked Python loop over
the buckets); the exposition is the same. Event-plane and index
state (events by type, malformed, orphans, gaps, replays, lag, blocks per tier, caps and
evictions, worker health) is read at scrape time by :class:`StateCollector` from the subscriber's and index's own
counters, on the event loop (``/metrics`` is an async handler), so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from indexer.index.native import BACKENDS as NATIVE_BACKENDS
from router.observe.agreement import AgreementMetrics
from router.observe.epp import EppMetrics
from router.observe.family import Family as _Family
from router.observe.pd import PdMetrics
from router.observe.process import installed_version, register_process_metrics

__all__ = [
    "RouterMetrics",
    "StateCollector",
    "WorkerSample",
    "installed_version",
    "register_process_metrics",
]


_LATENCY_BUCKETS = (
    50e-6, 100e-6, 200e-6, 300e-6, 450e-6, 700e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.5
)  # fmt: skip
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
_TOKEN_ERR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


class WorkerSample:
    """What the collector reads about one worker rank at scrape time."""

    __slots__ = ("dp_rank", "healthy", "index", "stale", "sub", "worker_id")

    def __init__(
        self, worker_id: str, dp_rank: int, healthy: bool, sub: Any | None, index: Any | None
    ) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.healthy = healthy
        self.sub = sub  # indexer.subscriber.WorkerStats
        self.index = index  # indexer.index.WorkerIndexStats
        self.stale = False


_SUB_COUNTERS = (
    ("messages", "event messages received"),
    ("malformed", "malformed event messages dropped"),
    ("gaps", "sequence gaps detected"),
    ("replays", "replay requests sent"),
    ("replay_failures", "replays that could not close a gap (worker index dropped)"),
    ("restarts", "publisher restarts detected (seq went backwards, or a resume met a new process)"),
    ("unknown_events", "events of unknown type skipped"),
)

#: Per worker rank counters of the index itself (``indexer.index.WorkerIndexStats``).
_INDEX_COUNTERS = (
    ("duplicate_stores", "stores of a block already held on that tier (each needs a removal)"),
    ("partial_group_events", "events of sliding-window or Mamba KV groups (not applied)"),
)


class StateCollector(Collector):
    def __init__(self, sample: Callable[[], Iterable[WorkerSample]]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "dp_rank"]
        stale = GaugeMetricFamily(
            "kvrouter_worker_events_stale",
            "1 if the worker took traffic but published no KV event for health.stale_events_s",
            labels=["worker"],
        )
        healthy = GaugeMetricFamily(
            "kvrouter_worker_healthy", "1 if the worker passes health checks", labels=["worker"]
        )
        connected = GaugeMetricFamily(
            "kvrouter_subscriber_connected",
            "1 once the event subscriber is connected and replayed",
            labels=labels,
        )
        lag = GaugeMetricFamily(
            "kvrouter_event_lag_seconds",
            "now minus the timestamp of the last event batch applied",
            labels=labels,
        )
        last_seq = GaugeMetricFamily(
            "kvrouter_event_last_seq", "last applied event sequence number", labels=labels
        )
        events = CounterMetricFamily(
            "kvrouter_events_applied",
            "KV events applied to the index, by type (the index counts them per rank, not per tier)",
            labels=[*labels, "type"],
        )
        counters = {
            name: CounterMetricFamily(f"kvrouter_events_{name}", doc, labels=labels)
            for name, doc in _SUB_COUNTERS
        }
        blocks = GaugeMetricFamily(
            "kvrouter_index_blocks",
            "engine blocks indexed per worker and tier",
            labels=[*labels, "tier"],
        )
        idx_orphans = CounterMetricFamily(
            "kvrouter_index_orphan_blocks",
            "blocks dropped because their parent was unknown",
            labels=labels,
        )
        idx_counters = {
            name: CounterMetricFamily(f"kvrouter_index_{name}", doc, labels=labels)
            for name, doc in _INDEX_COUNTERS
        }
        evicted = CounterMetricFamily(
            "kvrouter_index_evicted_entries",
            "entries evicted, least recently used first, by the cap that did: index_cap "
            "(max_index_entries) or rank_cap (the rank's own: kvrouter_index_rank_max_entries); "
            "approximate: what the tree of a worker without events forgot at its capacity",
            labels=[*labels, "reason"],
        )
        rank_cap = GaugeMetricFamily(
            "kvrouter_index_rank_max_entries",
            "the rank's cap on its index entries (0: none): its KV capacity x "
            "index.capacity_margin (source=capacity), or index.max_rank_entries (default)",
            labels=[*labels, "source"],
        )
        sources = GaugeMetricFamily(
            "kvrouter_index_source",
            "1 for where the rank's index entries come from: events (its KV events) or "
            "approximate (what the router sent it: a worker without events)",
            labels=[*labels, "source"],
        )
        native = GaugeMetricFamily(
            "kvrouter_index_native",
            "1 for the implementation (c or python) each hot loop of the index runs",
            labels=["concern", "backend"],
        )
        for concern, backend in sorted(NATIVE_BACKENDS.items()):
            native.add_metric([concern, backend], 1.0)
        seen_workers: set[str] = set()
        for s in self._sample():
            lv = [s.worker_id, str(s.dp_rank)]
            if s.worker_id not in seen_workers:
                seen_workers.add(s.worker_id)
                healthy.add_metric([s.worker_id], 1.0 if s.healthy else 0.0)
                stale.add_metric([s.worker_id], 1.0 if s.stale else 0.0)
            st = s.sub
            if st is not None:
                ready = bool(getattr(st, "connected", False)) and bool(
                    getattr(st, "replay_done", False)
                )
                connected.add_metric(lv, 1.0 if ready else 0.0)
                lag_s = getattr(st, "lag_s", None)
                if lag_s is not None:
                    lag.add_metric(lv, float(lag_s))
                seq = getattr(st, "last_seq", None)
                if seq is not None and seq >= 0:
                    last_seq.add_metric(lv, float(seq))
                for typ, n in (getattr(st, "events_by_type", None) or {}).items():
                    events.add_metric([*lv, str(typ)], float(n))
                for name, _doc in _SUB_COUNTERS:
                    counters[name].add_metric(lv, float(getattr(st, name, 0) or 0))
            ix = s.index
            if ix is not None:
                for tier, n in ix.blocks_by_tier.items():
                    blocks.add_metric([*lv, tier], float(n))
                idx_orphans.add_metric(lv, float(getattr(ix, "orphan_blocks", 0)))
                for name, _doc in _INDEX_COUNTERS:
                    idx_counters[name].add_metric(lv, float(getattr(ix, name, 0)))
                evicted.add_metric([*lv, "index_cap"], float(getattr(ix, "evicted_entries", 0)))
                evicted.add_metric([*lv, "rank_cap"], float(getattr(ix, "rank_evicted_entries", 0)))
                forgot = float(getattr(ix, "forgotten_entries", 0))
                evicted.add_metric([*lv, "approximate"], forgot)
                sources.add_metric([*lv, getattr(ix, "source", "events")], 1.0)
                cap, source = getattr(ix, "max_entries", 0), getattr(ix, "cap_source", "")
                rank_cap.add_metric([*lv, source or "none"], float(cap))
        yield healthy
        yield stale
        yield connected
        yield lag
        yield last_seq
        yield events
        yield from counters.values()
        yield blocks
        yield idx_orphans
        yield from idx_counters.values()
        yield evicted
        yield rank_cap
        yield sources
        yield native


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.registry = r
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.route_decisions = _Family(
            "counter",
            "kvrouter_route_decisions",
            "placement decisions per chosen worker",
            ["worker", "kind"],
            registry=r,
        )
        self.matched_ratio = _Family(
            "histogram",
            "kvrouter_matched_block_ratio",
            "matched / request blocks on the chosen worker",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.route_latency = _Family(
            "histogram",
            "kvrouter_route_latency_seconds",
            "time to answer POST /route (after the body is read)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_latency = _Family(
            "histogram",
            "kvrouter_decision_latency_seconds",
            "time to hash, match and score one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.proxied_requests = _Family(
            "counter",
            "kvrouter_proxied_requests",
            "OpenAI requests proxied or placed by the endpoint picker, by worker, endpoint, status",
            ["worker", "endpoint", "status"],
            registry=r,
        )
        self.retries = _Family(
            "counter",
            "kvrouter_proxy_retries",
            "attempts moved to the next worker before any byte was sent",
            ["worker", "reason"],
            registry=r,
        )
        self.rejected = _Family(
            "counter",
            "kvrouter_rejected_requests",
            "requests answered by the router itself with an error",
            ["status"],
            registry=r,
        )
        self.closed_connections = _Family(
            "counter",
            "kvrouter_http_connections_closed",
            "client connections the router closed itself (head_timeout: no complete request head "
            "within server.head_timeout_s; connection_cap: past the connection cap, after a 503)",
            ["reason"],
            registry=r,
        )
        self.ttfb = _Family(
            "histogram",
            "kvrouter_time_to_first_byte_seconds",
            "time from request to the first upstream body byte (proxy and endpoint picker)",
            ["worker"],
            buckets=_TTFB_BUCKETS,
            registry=r,
        )
        self.inflight = _Family(
            "gauge",
            "kvrouter_inflight_requests",
            "proxied requests (and endpoint picker ones) in flight per worker",
            ["worker"],
            registry=r,
        )
        self.predicted_tokens = _Family(
            "counter",
            "kvrouter_cached_tokens_predicted",
            "cached prompt tokens the router predicted on the "
            "chosen worker (for requests whose worker reported usage)",
            ["worker"],
            registry=r,
        )
        self.actual_tokens = _Family(
            "counter",
            "kvrouter_cached_tokens_actual",
            "cached prompt tokens the worker reported (usage.prompt_tokens_details.cached_tokens)",
            ["worker"],
            registry=r,
        )
        self.cached_error = _Family(
            "histogram",
            "kvrouter_cached_tokens_abs_error",
            "|predicted - actual| cached prompt tokens per request",
            ["worker"],
            buckets=_TOKEN_ERR_BUCKETS,
            registry=r,
        )
        self.predicted_blocks = _Family(
            "gauge",
            "kvrouter_predicted_blocks",
            "(block, worker) predictions alive against herding",
            registry=r,
        )
        self.accounted_routes = _Family(
            "gauge",
            "kvrouter_accounted_routes",
            "/route placements accounted and not yet released",
            registry=r,
        )
        self.route_accounts_ended = _Family(
            "counter",
            "kvrouter_route_accounts_ended",
            "accounted /route placements ended, by how: released, expired (TTL), evicted "
            "(over route.max_accounted), worker_removed",
            ["reason"],
            registry=r,
        )
        self.tokenize_latency = _Family(
            "histogram",
            "kvrouter_tokenize_seconds",
            "time to tokenize a text prompt",
            ["tokenizer"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pd = PdMetrics(r)  # prefill/decode disaggregation's own families
        self.epp = EppMetrics(r)  # the endpoint picker's door
        self.agreement_m = AgreementMetrics(r)  # the closed loop's, per worker
        self._families = [v for v in vars(self).values() if isinstance(v, _Family)]
        self._families += self.agreement_m.families

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: ``labels`` costs several µs on the hot path."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def forget_worker(self, worker: str) -> None:
        """Drop every series labelled with this worker (a removed worker leaves no stale ones)."""
        self._children = {k: v for k, v in self._children.items() if worker not in k[1]}
        for family in self._families:
            if "worker" in family.labelnames:
                at = family.labelnames.index("worker")
                for key in [k for k in family._series if k[at] == worker]:
                    family.remove(*key)

    # ------------------------------------------- router.placement.ports.PlacementMetrics

    def decided(self, seconds: float) -> None:
        self.decision_latency.observe(seconds)

    def routed(self, worker: str, kind: str, matched_ratio: float | None) -> None:
        self.child(self.route_decisions, worker, kind).inc()
        if matched_ratio is not None:
            self.matched_ratio.observe(matched_ratio)

    def flight_started(self, worker: str) -> None:
        self.child(self.inflight, worker).inc()

    def first_byte(self, worker: str, seconds: float) -> None:
        self.child(self.ttfb, worker).observe(seconds)

    def proxied(self, worker: str, endpoint: str, status: str) -> None:
        self.child(self.inflight, worker).dec()
        self.child(self.proxied_requests, worker, endpoint, status).inc()

    def account_ended(self, reason: str) -> None:
        self.child(self.route_accounts_ended, reason).inc()

    def cached_tokens(self, worker: str, predicted: int, actual: int, leg: str = "") -> None:
        if leg:
            self.pd.cached(leg, predicted, actual)
        self.child(self.predicted_tokens, worker).inc(predicted)
        self.child(self.actual_tokens, worker).inc(actual)
        self.child(self.cached_error, worker).observe(abs(predicted - actual))

    def placement_state(self, predicted_blocks: int, accounted_routes: int) -> None:
        self.predicted_blocks.set(predicted_blocks)
        self.accounted_routes.set(accounted_routes)

    def pd_decided(self, decision: str, reason: str) -> None:
        self.pd.decided(decision, reason)

    def agreement(self, worker: str, reason: str, disagrees: bool) -> None:
        self.agreement_m.changed(worker, reason, disagrees)
