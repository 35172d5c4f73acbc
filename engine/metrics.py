"""Prometheus metrics of one engine app, on the app's own ``CollectorRegistry``.

Gauges and counters are read from the engine loop's latest :class:`EngineStats` at scrape time
(vLLM's names, labelled ``model_name``); request latencies are histograms the handlers observe.
``vllm:cache_config_info`` says the cache's size as vLLM does (a gauge of 1 whose labels are the
cache config, ``num_gpu_blocks`` among them), with the DISK and EXTERNAL tiers' sizes vLLM has
no label for: a router caps this worker's entries in its index at them.

The prefill/decode exchange (:mod:`engine.pd`) has its own ``kvrouter_engine_pd_*`` counters
(:class:`_PdCollector`; docs/metrics.md lists them): pulls served and refused on the prefill
side, done, failed and recomputed on the decode side (failures by
:data:`engine.pd.params.FAILURE_REASONS`), blocks and bytes pulled, leases opened and ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.config import EngineConfig
from engine.engine import EngineStats
from engine.pd.legs import PdCounters
from engine.pd.params import FAILURE_REASONS

__all__ = ["EngineMetrics", "RequestTimer", "cache_config_labels"]


def cache_config_labels(cfg: EngineConfig, dp_rank: int = 0) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: vLLM's (its cache config's fields as strings,
    ``engine`` the data-parallel rank), then ``num_disk_blocks`` and ``num_external_blocks``
    for the tiers this engine has and vLLM does not."""
    labels = {
        "block_size": str(cfg.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "engine": str(dp_rank),
        "num_cpu_blocks": str(cfg.num_cpu_blocks),
        "num_gpu_blocks": str(cfg.num_gpu_blocks),
    }
    if cfg.disk_dir is not None:
        labels["num_disk_blocks"] = str(cfg.num_disk_blocks)
    if (cfg.external_url or cfg.external_dir) and cfg.num_external_blocks is not None:
        labels["num_external_blocks"] = str(cfg.num_external_blocks)
    return labels


_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10)
#: vLLM's inter-token buckets, with the sim's 8-20 ms decode steps split finer
_TPOT_BUCKETS = (0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip


class _StatsCollector(Collector):
    def __init__(
        self, model: str, stats: Callable[[], EngineStats], cache: Mapping[str, str]
    ) -> None:
        self.model = model
        self.stats = stats
        self.cache = dict(cache)

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        m = [self.model]
        if self.cache:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=list(self.cache),
            )
            info.add_metric(list(self.cache.values()), 1.0)
            yield info

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.running)
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting (or loading KV).", s.waiting + s.loading
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "Fraction of GPU KV blocks in use (0-1).", s.kv_usage
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits
        )
        yield counter("vllm:prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("vllm:num_preemptions", "Preemptions by recompute.", s.preemptions)
        blocks = GaugeMetricFamily(
            "kvrouter_engine_blocks", "KV blocks held per tier.", labels=["model_name", "tier"]
        )
        for tier, n in s.blocks.items():
            blocks.add_metric([self.model, tier], n)
        yield blocks
        events = CounterMetricFamily(
            "kvrouter_engine_kv_events",
            "KV events published, by type.",
            labels=["model_name", "type"],
        )
        for kind, n in s.events.items():
            events.add_metric([self.model, kind], n)
        yield events
        yield counter(
            "kvrouter_engine_tier_errors",
            "Failed tier reads/writes (cache lost, request served).",
            s.tier_errors,
        )
        yield counter(
            "kvrouter_engine_offload_skipped",
            "Copies to a lower tier skipped for lack of slots.",
            s.offload_skipped,
        )


#: ``kvrouter_engine_pd_leases_ended``'s ``how`` label (engine.pd.leases: refused is counted apart,
#: those leases never began)
LEASE_ENDINGS = ("pulled", "expired", "evicted")

#: the PD metrics: name -> (type, label besides model_name, help); the one place they are named (docs/metrics.md lists them)
PD_METRICS = {
    "kvrouter_engine_pd_pulls_served": ("counter", "", "Prefill side: pulls answered with blocks."),
    "kvrouter_engine_pd_pulls_refused": ("counter", "reason", "Prefill side: pulls refused."),
    "kvrouter_engine_pd_pulls_done": (
        "counter", "", "Decode side: pulls whose blocks arrived and were checked."
    ),
    "kvrouter_engine_pd_pulls_failed": (
        "counter", "reason", "Decode side: pulls that failed (answered 500, or recomputed)."
    ),
    "kvrouter_engine_pd_pulls_recomputed": (
        "counter", "", "Decode side: failed pulls prefilled here (--kv-load-failure-policy recompute)."
    ),
    "kvrouter_engine_pd_pulled_blocks": ("counter", "", "Decode side: KV blocks pulled."),
    "kvrouter_engine_pd_pulled_bytes": ("counter", "", "Decode side: KV bytes pulled."),
    "kvrouter_engine_pd_leases_opened": ("counter", "", "Prefill side: leases granted."),
    "kvrouter_engine_pd_leases_ended": (
        "counter", "how", "Prefill side: leases ended: pulled, expired, evicted (by the bound)."
    ),
    "kvrouter_engine_pd_leases_refused": (
        "counter", "", "Prefill side: leases not granted (larger than the bound)."
    ),
    "kvrouter_engine_pd_leases_held": ("gauge", "", "Prefill side: leases held now."),
    "kvrouter_engine_pd_lease_blocks": ("gauge", "", "Prefill side: KV blocks leases hold now."),
}  # fmt: skip


class _PdCollector(Collector):
    def __init__(
        self, model: str, stats: Callable[[], EngineStats], pd: Callable[[], PdCounters]
    ) -> None:
        self.model, self.stats, self.pd = model, stats, pd

    @staticmethod
    def _family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
        kind, label, doc = PD_METRICS[name]
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        return cls(name, doc, labels=["model_name", *([label] if label else [])])

    def collect(self) -> Iterator[Metric]:
        s, c, m = self.stats(), self.pd(), self.model
        plain = {
            "kvrouter_engine_pd_pulls_served": c.served,
            "kvrouter_engine_pd_pulls_done": c.done,
            "kvrouter_engine_pd_pulls_recomputed": c.recomputed,
            "kvrouter_engine_pd_pulled_blocks": c.blocks,
            "kvrouter_engine_pd_pulled_bytes": c.bytes,
            "kvrouter_engine_pd_leases_opened": s.leases_granted,
            "kvrouter_engine_pd_leases_refused": s.leases_ended.get("refused", 0),
            "kvrouter_engine_pd_leases_held": s.leases_held,
            "kvrouter_engine_pd_lease_blocks": s.lease_blocks,
        }
        for name, value in plain.items():
            family = self._family(name)
            family.add_metric([m], value)
            yield family
        labelled = (  # every label value, zeros too: a rate over a series that appears is wrong
            ("kvrouter_engine_pd_pulls_refused", FAILURE_REASONS, c.refused),
            ("kvrouter_engine_pd_pulls_failed", FAILURE_REASONS, c.failed),
            ("kvrouter_engine_pd_leases_ended", LEASE_ENDINGS, s.leases_ended),
        )
        for name, keys, counts in labelled:
            family = self._family(name)
            for key in keys:
                family.add_metric([m, key], counts.get(key, 0))
            yield family


class EngineMetrics:
    def __init__(
        self,
        model: str,
        stats: Callable[[], EngineStats],
        cache_config: Mapping[str, str] | None = None,
        pd: Callable[[], PdCounters] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(model, stats, cache_config or {}))
        if pd is not None:
            self.registry.register(_PdCollector(model, stats, pd))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (wall clock, from request receipt).",
            ["model_name"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency (wall clock).",
            ["model_name"],
            registry=self.registry,
        ).labels(model)
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Time per output token of each request: first output to the end over the tokens after"
            " the first (wall clock).",
            ["model_name"],
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model)


class RequestTimer:
    """One request's latencies as vLLM's histograms take them: the TTFT at its first output, the
    end-to-end latency and the time per output token at its end. A router's client sees the
    same times plus the hop; the difference says whether a slow stream is the engine's."""

    __slots__ = ("first_at", "metrics", "start")

    def __init__(self, metrics: EngineMetrics, start: float) -> None:
        self.metrics = metrics
        self.start = start
        self.first_at: float | None = None

    def first(self) -> None:
        self.first_at = now = time.monotonic()
        self.metrics.ttft.observe(now - self.start)

    def done(self, output_tokens: int) -> None:
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.start)
        if self.first_at is not None and output_tokens > 1:
            self.metrics.tpot.observe((now - self.first_at) / (output_tokens - 1))
