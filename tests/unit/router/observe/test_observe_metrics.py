"""The router's own metric families: the exposition Prometheus reads back, bucket edges, labels,
and series dropped with their worker."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.observe.metrics import RouterMetrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    r = CollectorRegistry()
    m = RouterMetrics(r)
    for v in (0.00005, 0.00006, 0.0002, 7.0):  # on a bound, between two, past the last
        m.route_latency.observe(v)
    got = samples(r)

    def bucket(le: str) -> float:
        return got[("kvrouter_route_latency_seconds_bucket", (("le", le),))]

    assert bucket("5e-05") == 1.0  # 0.00005 <= 5e-05
    assert bucket("0.0001") == 2.0
    assert bucket("0.0002") == 3.0
    assert bucket("0.5") == 3.0
    assert bucket("+Inf") == 4.0
    assert got[("kvrouter_route_latency_seconds_count", ())] == 4.0
    assert got[("kvrouter_route_latency_seconds_sum", ())] == pytest.approx(7.00031)


def test_labelled_counters_gauges_and_forgetting_a_worker() -> None:
    r = CollectorRegistry()
    m = RouterMetrics(r)
    m.child(m.route_decisions, "w0", "route").inc()
    m.child(m.route_decisions, "w0", "route").inc()
    m.child(m.route_decisions, "w1", "proxy").inc(3)
    m.child(m.inflight, "w0").inc()
    m.child(m.inflight, "w0").dec()
    m.child(m.inflight, "w1").inc()
    m.rejected.labels(413).inc()  # label values are exposed as text
    m.predicted_blocks.set(5)
    got = samples(r)
    w0 = (("kind", "route"), ("worker", "w0"))
    assert got[("kvrouter_route_decisions_total", w0)] == 2.0
    assert got[("kvrouter_route_decisions_total", (("kind", "proxy"), ("worker", "w1")))] == 3.0
    assert got[("kvrouter_inflight_requests", (("worker", "w0"),))] == 0.0
    assert got[("kvrouter_rejected_requests_total", (("status", "413"),))] == 1.0
    assert got[("kvrouter_predicted_blocks", ())] == 5.0
    with pytest.raises(ValueError, match="expected labels"):
        m.route_decisions.labels("w0")

    m.forget_worker("w0")
    got = samples(r)
    assert ("kvrouter_route_decisions_total", w0) not in got
    assert ("kvrouter_inflight_requests", (("worker", "w0"),)) not in got
    assert got[("kvrouter_inflight_requests", (("worker", "w1"),))] == 1.0
    # a later request for the forgotten worker starts a fresh series, not the stale cached one
    m.child(m.route_decisions, "w0", "route").inc()
    assert samples(r)[("kvrouter_route_decisions_total", w0)] == 1.0
