"""A live PD fleet's rows (kvrouter.replay.live_pd): their names, as the virtual sweep names its
rows, and their columns from the engines' counters."""

from __future__ import annotations

from kvrouter.replay.fleet import TPOT, EngineCounters, FleetSpec
from kvrouter.replay.live import LiveTargets
from kvrouter.replay.live_pd import engine_tpot_ms, pd_columns, pd_label

FAILED = "kvrouter_engine_pd_pulls_failed_total"


def _engine(role: str, requests: int, queried: int = 0, cached: int = 0, **pd: float):
    return EngineCounters(requests, queried, cached, 0, role=role, queried_tokens=queried, pd=pd)


def test_the_columns_come_from_each_sides_counters() -> None:
    engines = [
        _engine("prefill", 3, queried=1000, cached=250),
        _engine("prefill", 1, queried=1000, cached=0),
        _engine("decode", 5, kvrouter_engine_pd_pulls_done_total=3,
                kvrouter_engine_pd_pulled_bytes_total=2e9, **{FAILED: 1, f"{FAILED}:refused": 1}),
        _engine("decode", 5, kvrouter_engine_pd_pulls_done_total=1,
                **{FAILED: 2, f"{FAILED}:timeout": 2}),
    ]  # fmt: skip
    cols = pd_columns(engines)
    assert cols == {
        "remote_%": 40.0,  # 4 prefill legs for 10 requests served
        "P_hit_%": 12.5,  # 250 of the 2,000 tokens the prefill engines looked up
        "pulls": 4,
        "pull_fail": "3 (refused 1, timeout 2)",
        "GB_pulled": 2.0,
    }
    assert pd_columns([*engines[:2], _engine("decode", 4)])["pull_fail"] == "0"


def test_rows_are_named_as_the_virtual_sweep_names_them() -> None:
    t = LiveTargets(fleet=FleetSpec(pd=(2, 6)), pd_mode="cost", vllm_router_policy="kv_aware")
    assert pd_label("kvrouter", (2, 6), 8, t) == "kvrouter 2:6 cost"
    assert pd_label("kvrouter-aggregated", (2, 6), 8, t) == "kvrouter 8 aggregated"
    assert pd_label("vllm-router", (2, 6), 8, t) == "vllm-router 2:6 kv_aware"
    assert pd_label("smg", (2, 6), 8, t) == "smg 2:6"
    assert FleetSpec(pd=(2, 6)).roles == ["prefill"] * 2 + ["decode"] * 6


def test_the_engines_tpot_is_the_decoding_engines_mean_over_their_requests() -> None:
    engines = [
        _engine("prefill", 4, **{f"{TPOT}_sum": 9.0, f"{TPOT}_count": 4}),  # one-token legs
        _engine("decode", 3, **{f"{TPOT}_sum": 0.03, f"{TPOT}_count": 3}),
        _engine("decode", 1, **{f"{TPOT}_sum": 0.014, f"{TPOT}_count": 1}),
    ]
    assert engine_tpot_ms(engines) == 11.0  # 44 ms over 4 requests; the prefill side aside
    assert engine_tpot_ms([_engine("both", 2)]) is None  # an engine that does not report it
