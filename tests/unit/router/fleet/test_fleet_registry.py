"""Registry views (models, pools) and parsing worker load from vLLM / SGLang /metrics text."""

from __future__ import annotations

import pytest

from router.errors import NotFound
from router.fleet.health import parse_load_metrics
from router.fleet.registry import Registry
from router.settings import HealthSettings, WorkerConfig

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:prompt_tokens_total{model_name="m"} 1234.0
"""
SGLANG = """sglang:num_running_reqs{model_name="m"} 5
sglang:num_queue_reqs{model_name="m"} 7
sglang:token_usage{model_name="m"} 0.9
"""


def test_parse_load_metrics():
    v = parse_load_metrics(VLLM)
    assert v is not None and (v.running, v.waiting, v.kv_usage) == (4.0, 2.0, 0.42)
    s = parse_load_metrics(SGLANG)
    assert s is not None and (s.running, s.waiting, s.kv_usage) == (5.0, 7.0, 0.9)
    assert parse_load_metrics("other_metric 1\n") is None
    assert (
        parse_load_metrics("vllm:num_requests_running NaN\nvllm:num_requests_waiting x\n") is None
    )


def _w(i: str, **kw) -> WorkerConfig:
    return WorkerConfig(id=i, url=f"http://h/{i}", events_endpoint="tcp://h:1", **kw)


def test_models_pools_and_health_marks():
    r = Registry(HealthSettings(unhealthy_after=2))
    r.add(_w("a", model="llama", pool="p"))
    r.add(_w("b", pool="p", dp_ranks=2))
    r.add(_w("c", model="qwen"))
    assert {s.id for s in r.candidates("llama")} == {"a", "b"}  # b's models are not known yet
    r.workers["b"].discovered_models = frozenset({"mistral"})
    assert [s.id for s in r.candidates("llama")] == ["a"]
    assert len(r.candidates(None)) == 3
    with pytest.raises(NotFound, match="gpt"):
        r.candidates("gpt")
    assert r.known_models() == {"llama", "mistral", "qwen"}
    assert r.pools() == [[("a", 0), ("b", 0), ("b", 1)]]
    r.mark_failure("a", "x")
    assert r.workers["a"].healthy
    r.mark_failure("a", "y")
    assert not r.workers["a"].healthy and r.workers["a"].last_error == "y"
    r.mark_success("a")
    assert r.workers["a"].healthy
    r.mark_failure("c", "refused", now=True)
    assert not r.workers["c"].healthy
    r.remove("b")
    assert r.pools() == []
