"""A worker's KV capacity from its /metrics, as vLLM and SGLang print it (tests/fixtures/metrics:
vLLM's ``vllm:cache_config_info`` with data parallelism and with CPU offload, SGLang's pool in
tokens over its page size): engine blocks per tier and per dp rank, what caps the rank's entries
in the router's index."""

from __future__ import annotations

from pathlib import Path

from router.fleet.capacity import parse_kv_capacity, rank_capacities

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "metrics"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_vllm_one_line_per_engine_is_one_per_dp_rank() -> None:
    found = parse_kv_capacity(fixture("vllm_dp2.txt"))
    assert found == {0: {"GPU": 27413}, 1: {"GPU": 27398}}  # num_cpu_blocks="None": no tier
    assert rank_capacities(found, 2) == [{"GPU": 27413}, {"GPU": 27398}]
    assert rank_capacities(found, 3)[2] is None  # a rank it says nothing of: not known


def test_vllm_cpu_offload_sizes_the_cpu_tier() -> None:
    found = parse_kv_capacity(fixture("vllm_cpu_offload.txt"))
    assert found == {0: {"GPU": 13104, "CPU_PINNED": 8192}}


def test_sglang_tokens_over_page_size_per_dp_rank() -> None:
    found = parse_kv_capacity(fixture("sglang_dp2.txt"))
    # tp ranks repeat the pool; 262144 tokens / page 16
    assert found == {0: {"GPU": 16384}, 1: {"GPU": 16320}}
    # no page size exported: SGLang's default, 1 token a page; no dp_rank label: every rank
    found = parse_kv_capacity(fixture("sglang_page1.txt"))
    assert found == {None: {"GPU": 1048576}}
    assert rank_capacities(found, 2) == [{"GPU": 1048576}, {"GPU": 1048576}]


def test_one_rank_worker_takes_the_one_rank_it_reports() -> None:
    """A data-parallel rank served on its own port labels its line with its rank number."""
    line = 'vllm:cache_config_info{block_size="16",engine="3",num_gpu_blocks="500"} 1.0\n'
    assert rank_capacities(parse_kv_capacity(line), 1) == [{"GPU": 500}]
    assert rank_capacities(parse_kv_capacity(line), 2) == [None, None]


def test_no_capacity_and_garbage_are_not_a_capacity() -> None:
    assert parse_kv_capacity("vllm:num_requests_running 1\n") == {}
    assert rank_capacities({}, 1) == [None]
    bad = (
        'vllm:cache_config_info{num_gpu_blocks="None",engine="0"} 1.0\n'
        'vllm:cache_config_info{num_gpu_blocks="-5",engine="1"} 1.0\n'
        'vllm:cache_config_info{num_gpu_blocks="1e300",engine="2"} 1.0\n'
        'vllm:cache_config_info_extra{num_gpu_blocks="7"} 1.0\n'
        "sglang:max_total_num_tokens NaN\n"
        'sglang:max_total_num_tokens{dp_rank="0"} x\n'
        'vllm:cache_config_info{num_gpu_blocks="9"\n'
    )
    assert parse_kv_capacity(bad) == {}
    # quoted commas, braces and escaped quotes in other labels do not confuse the parse
    odd = 'vllm:cache_config_info{a="x,}\\"y",num_gpu_blocks="42",num_cpu_blocks="None"} 1\n'
    assert parse_kv_capacity(odd) == {None: {"GPU": 42}}
