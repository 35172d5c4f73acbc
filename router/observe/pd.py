"""Metrics of prefill/decode disaggregation (docs/architecture.md §10): the decisions the
placement core takes, the doors' fallbacks, each leg's latency and each leg's predicted against
reported cached tokens. Light families (:mod:`router.observe.family`) on the router's registry,
kept beside :class:`router.observe.metrics.RouterMetrics`, which owns one :class:`PdMetrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.observe.family import Family

__all__ = ["PdMetrics"]

_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PdMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.decisions = Family(
            "counter",
            "kvrouter_pd_decisions_total",
            "disaggregated fleets' picks: prefill on the decode worker (local) or on a prefill "
            "worker (remote), by reason",
            ["decision", "reason"],
            registry=r,
        )
        self.fallbacks = Family(
            "counter",
            "kvrouter_pd_fallbacks_total",
            "remote picks that fell back before the decode worker's first byte, by cause "
            "(prefill_error, prefill_timeout, prefill_no_params, decode_kv_load)",
            ["cause"],
            registry=r,
        )
        self.epochs = Family(
            "counter",
            "kvrouter_pd_prefill_restarts_total",
            "prefill workers seen answering with a new engine id (a restart: a new epoch; the "
            "log names the worker)",
            [],
            registry=r,
        )
        self.leg_seconds = Family(
            "histogram",
            "kvrouter_pd_leg_seconds",
            "a disaggregated request's legs: prefill (the prefill worker's whole answer) and "
            "decode (dispatch to the decode worker's first byte)",
            ["leg"],
            buckets=_LEG_BUCKETS,
            registry=r,
        )
        self.predicted_tokens = Family(
            "counter",
            "kvrouter_pd_predicted_cached_tokens_total",
            "cached prompt tokens the router predicted for each leg of remote picks",
            ["leg"],
            registry=r,
        )
        self.actual_tokens = Family(
            "counter",
            "kvrouter_pd_actual_cached_tokens_total",
            "cached prompt tokens each leg's worker reported (vLLM >= 0.32's decode worker "
            "reports the prefill worker's real hit)",
            ["leg"],
            registry=r,
        )

    def restarted(self) -> None:
        self.epochs.inc()

    def decided(self, decision: str, reason: str) -> None:
        self.decisions.labels(decision, reason).inc()

    def fell_back(self, cause: str) -> None:
        self.fallbacks.labels(cause).inc()

    def leg(self, leg: str, seconds: float) -> None:
        self.leg_seconds.labels(leg).observe(seconds)

    def cached(self, leg: str, predicted: int, actual: int) -> None:
        self.predicted_tokens.labels(leg).inc(predicted)
        self.actual_tokens.labels(leg).inc(actual)
