"""A prefill/decode fleet in virtual time (kvrouter.replay.virtual, pd_policy, pd_sweep): remote
prefills happen under ``always`` and never under ``never``, decode engines run no long prefill,
a pull costs its bytes over the link plus its latency (a TTFT computed by hand from the sim's
timing model), a prefill no longer stretches the steps of sequences decoding elsewhere, and the
CLI's sweep runs aggregated beside every ratio and names a row."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from engine.runner.sim import SIM_DEFAULTS
from kvrouter.replay.cli import main
from kvrouter.replay.live_client import LiveOutcome
from kvrouter.replay.pd_sweep import best_row, explain, ratio_mode_of, recommend
from kvrouter.replay.slo import DEFAULT_SLO, missed, tpot_s
from kvrouter.replay.trace import TraceRequest
from kvrouter.replay.virtual import VirtualFleet, VirtualRun, run_virtual
from router.settings import Settings

TB = 64  # trace block (tokens)
BS = 16


def _settings(mode: str) -> Settings:
    s = Settings(block_size=BS)
    return msgspec.structs.replace(s, pd=msgspec.structs.replace(s.pd, mode=mode))


def _req(t: float, ids: list[int], out: int = 8) -> TraceRequest:
    return TraceRequest(t, tuple(ids), len(ids) * TB, out)


def _workload() -> list[TraceRequest]:
    """Twelve requests, three shared prefixes of 8 trace blocks (512 tokens) and a unique tail,
    arriving 50 ms apart: prompts long enough to cross the threshold mode's 256 tokens."""
    return [
        _req(0.05 * i, [1000 * (i % 3) + k for k in range(8)] + [50_000 + i]) for i in range(12)
    ]


def _run(mode: str, prefill: int = 1, workers: int = 3, **kw: float) -> VirtualRun:
    fleet = VirtualFleet(workers=workers, block_size=BS, gpu_blocks=2048, prefill=prefill,
                         sim_options=dict(kw))  # fmt: skip
    return run_virtual(_workload(), "kvrouter", fleet, trace_block=TB, settings=_settings(mode))


def test_always_prefills_every_prompt_remotely_and_decode_engines_run_no_long_prefill() -> None:
    run = _run("always")
    assert run.policy == "kvrouter 1:2 always"
    assert all(o.error is None and o.ttft_s is not None for o in run.outcomes)
    assert run.extra["remote_%"] == 100.0 and run.extra["fallback"] == 0
    # a decode engine computes only what it did not pull: the prompt's last block at most
    assert 0 < run.extra["d_max_prefill"] <= BS
    # every request was served by a decode engine (w1, w2), none by the prefill engine (w0)
    assert {o.worker for o in run.outcomes} <= {"w1", "w2"}
    assert run.engines[0].requests == 0 and run.engines[1].requests + run.engines[2].requests == 12
    # the first request's decode leg reports the prefill engine's hit (none: it was first)
    assert run.outcomes[0].cached_tokens == 0
    # later ones reuse what the prefill engine holds of their prefix (vLLM reports its hit)
    assert sum(o.cached_tokens for o in run.outcomes) > 0


def test_never_prefills_on_the_decode_engines_only() -> None:
    run = _run("never")
    assert run.extra["remote_%"] == 0.0
    assert run.extra["d_max_prefill"] >= 8 * TB - 8 * TB % BS  # whole prompts, on D
    assert {o.worker for o in run.outcomes} <= {"w1", "w2"}


def _ttft_by_hand(tokens: int, gbps: float) -> float:
    """One request on an idle 1:1 fleet: the prefill engine's step, the pull of its full blocks
    but the last token's, and the decode engine's step computing the last block."""
    p = SIM_DEFAULTS
    prefill = p["prefill_a"] * tokens**2 + p["prefill_b"] * tokens + p["prefill_c"]
    pulled = (tokens - 1) // BS
    rest = tokens - pulled * BS
    decode_first = p["prefill_a"] * rest**2 + p["prefill_b"] * rest + p["prefill_c"]
    transfer_s = pulled * BS * p["kv_bytes_per_token"] / (gbps * 1e9)
    return (prefill + decode_first + p["transfer_latency_ms"]) / 1e3 + transfer_s


@pytest.mark.parametrize("gbps", [12.5, 0.05])
def test_a_pull_costs_its_bytes_over_the_link_plus_its_latency(gbps: float) -> None:
    fleet = VirtualFleet(workers=2, block_size=BS, gpu_blocks=2048, prefill=1,
                         sim_options={"transfer_gbps": gbps})  # fmt: skip
    req = [_req(0.0, list(range(8)), out=2)]  # 512 tokens, 31 blocks pulled
    run = run_virtual(req, "kvrouter", fleet, trace_block=TB, settings=_settings("always"))
    assert run.outcomes[0].ttft_s == pytest.approx(_ttft_by_hand(512, gbps), rel=1e-9)
    # (at 0.05 GB/s the 31 blocks' 6 MB take 122 ms: the link is what the TTFT grew by)


def test_a_prefill_stretches_decode_steps_on_its_own_engine_only() -> None:
    # a long answer decoding, then a 2,048-token prompt arriving while it decodes
    reqs = [_req(0.0, [1], out=200), _req(0.5, list(range(100, 132)), out=2)]
    fleet = VirtualFleet(workers=1, block_size=BS, gpu_blocks=2048)
    agg = run_virtual(reqs, "kvrouter", fleet, trace_block=TB, settings=_settings("always"))
    pd_fleet = VirtualFleet(workers=2, block_size=BS, gpu_blocks=2048, prefill=1)
    pd = run_virtual(reqs, "kvrouter", pd_fleet, trace_block=TB, settings=_settings("always"))
    agg_tpot, pd_tpot = tpot_s(agg.outcomes[0]), tpot_s(pd.outcomes[0])
    assert agg_tpot is not None and pd_tpot is not None
    assert agg_tpot > pd_tpot  # the prefill's step held every one of its decoding tokens


def _trace_file(tmp_path: Path) -> Path:
    """The workload as a Mooncake trace file, for the CLI."""
    trace = tmp_path / "t.jsonl"
    with open(trace, "w") as f:
        for r in _workload():
            row = {"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
                   "output_length": r.output_length, "hash_ids": list(r.hash_ids)}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return trace


def test_the_cli_sweeps_ratios_beside_aggregated_and_names_a_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace_file(tmp_path)
    out = tmp_path / "pd.json"
    base = ["--trace", str(trace), "--trace-block", str(TB), "--workers", "3", "--gpu-blocks",
            "2048", "--pd-sweep", "--no-progress"]  # fmt: skip
    argv = [*base, "--pd-mode", "always,never", "--json", str(out), "--pd-tpot-ms", "1e6,1e-6"]
    assert main(argv) == 0
    written = json.loads(out.read_text())
    table = written["table"]
    assert [r["policy"] for r in table] == [
        "kvrouter 3 aggregated",
        "kvrouter 1:2 always",
        "kvrouter 2:1 always",
        "kvrouter 1:2 never",
        "kvrouter 2:1 never",
    ]
    assert all(r["ok"] == 12 for r in table)
    assert [r.get("remote_%") for r in table] == [None, 100.0, 100.0, 0.0, 0.0]
    best = max(table, key=lambda r: (r["goodput_rps"], -r["ttft_p99_ms"]))
    printed = capsys.readouterr().out
    if best["policy"] == "kvrouter 3 aggregated":
        assert "run aggregated (kvrouter 3 aggregated, no PD) for this trace" in printed
    else:
        ratio, mode = best["policy"].split()[1:]
        assert f"run {ratio} {mode} for this trace: goodput {best['goodput_rps']}" in printed
    # ... and why, against the row it had to beat most, in the output and the JSON
    advice = written["recommendation"]
    assert advice["run"] in printed and advice["why"] in printed
    agg = best["policy"] == "kvrouter 3 aggregated"
    name = best["policy"] if agg else " ".join(best["policy"].split()[1:])
    assert advice["why"].startswith(f"why {name} over ")
    # the same runs under two more TPOT objectives: one every answer meets, one none does
    by = written["goodput_by_objective"]
    assert list(by) == ["ttft<=2000ms,tpot<=1e+06ms", "ttft<=2000ms,tpot<=1e-06ms"]
    loose, tight = by.values()
    assert [r["policy"] for r in loose] == [r["policy"] for r in table]
    assert all(r["slo_%"] >= t["slo_%"] for r, t in zip(loose, table))
    assert all(r["goodput_rps"] == 0 for r in tight)  # (every answer has a TPOT: 8 tokens)
    assert printed.count("for this trace") == 3  # the default objectives' line, then one each
    # a ratio that is not the fleet's size, a bad mode or objective, live mode: refused first
    assert main([*base, "--pd-tpot-ms", "25,fast"]) == 2
    assert main([*base, "--pd-ratios", "1:3"]) == 2
    assert main([*base, "--pd-mode", "sometimes"]) == 2
    # a live sweep, a live PD fleet on servers already running
    assert main(["--mode", "live", "--trace", str(trace), "--pd-sweep"]) == 2
    live_pd = ["--mode", "live", "--trace", str(trace), "--pd", "1:2"]
    assert main([*live_pd, "--worker-url", "http://127.0.0.1:9"]) == 2


def _row(policy: str, goodput: float, p99: float = 1000.0) -> dict[str, object]:
    return {"policy": policy, "goodput_rps": goodput, "ttft_p99_ms": p99}


def test_the_sweep_names_a_ratio_and_mode_beside_what_it_had_to_beat() -> None:
    table = [
        _row("kvrouter 8 aggregated", 2.80),
        _row("kvrouter 2:6 always", 1.94),
        _row("kvrouter 4:4 always", 2.79),
        _row("kvrouter 2:6 cost", 2.81, p99=3900),
        _row("kvrouter 4:4 cost", 2.81, p99=3800),  # the same goodput, the lower p99: this one
    ]
    assert recommend(table) == (
        "run 4:4 cost for this trace: goodput 2.81 req/s vs kvrouter 8 aggregated: 2.8, "
        "4:4 always: 2.79"
    )
    assert best_row(table) is table[4]
    # a live run's peers stand beside: neither a PD row to run nor the aggregated one to beat
    peers = [_row("smg 4:4", 2.28), _row("vllm-router 4:4 kv_aware", 2.9)]
    assert recommend([*peers, *table]) == recommend(table)
    assert (
        ratio_mode_of("kvrouter 4:4 cost") == ("4:4", "cost")
        and ratio_mode_of("kvrouter 8 aggregated") is None
    )


def test_the_sweep_says_when_to_run_no_pd_at_all() -> None:
    table = [_row("kvrouter 8 aggregated", 3.49), _row("kvrouter 4:4 cost", 3.48),
             _row("kvrouter 2:6 always", 3.10)]  # fmt: skip
    assert recommend(table) == (
        "run aggregated (kvrouter 8 aggregated, no PD) for this trace: goodput 3.49 req/s "
        "vs the best PD row, 4:4 cost: 3.48"
    )
    assert recommend([{"policy": "kvrouter 8 aggregated", "goodput_rps": None}]).startswith(
        "no row"
    )


def _outcomes(*answers: tuple[float | None, float]) -> list[LiveOutcome]:
    """(TTFT s, TPOT s) per request, 11 output tokens each; a None TTFT: no answer."""
    return [LiveOutcome(i, ttft_s=t, e2e_s=None if t is None else t + 10 * tpot, output_tokens=11,
                        error=None if t is not None else "502")
            for i, (t, tpot) in enumerate(answers)]  # fmt: skip


def test_the_sweep_says_why_request_by_request() -> None:
    """Against the row it had to beat most: which requests met both objectives under one row
    only, what the other missed on them, and by how much (objectives: 2 s, 50 ms)."""
    agg = _outcomes((0.1, 0.01), (1.96, 0.01), (2.2, 0.01), (0.5, 0.1), (None, 0))
    cost = _outcomes((0.1, 0.01), (2.02, 0.01), (1.9, 0.02), (0.5, 0.04), (None, 0))
    assert [missed(o, DEFAULT_SLO) for o in agg] == [None, None, "ttft", "tpot", "error"]
    table = [_row("kvrouter 8 aggregated", 2.0), _row("vllm-router 4:4 kv_aware", 9.0),
             _row("kvrouter 4:4 cost", 3.0)]  # fmt: skip
    runs = [VirtualRun(str(r["policy"]), o, 1.0, 0.0, []) for r, o in zip(table, [agg, cost, cost])]
    assert explain(table, runs, DEFAULT_SLO) == (
        "why 4:4 cost over kvrouter 8 aggregated, request by request: 2 met both only under "
        "4:4 cost (kvrouter 8 aggregated: missed TTFT on 1, by 10.0 %; missed TPOT on 1, by "
        "100.0 %), 1 only under kvrouter 8 aggregated (4:4 cost: missed TTFT on 1, by 1.0 %)"
    )
    # aggregated best: its rival is the best PD row; a failed request counts as no answer
    table[0]["goodput_rps"] = 4.0
    runs[2].outcomes = _outcomes((0.1, 0.01), (None, 0), (2.2, 0.01), (0.5, 0.1), (None, 0))
    assert explain(table, runs, DEFAULT_SLO) == (
        "why kvrouter 8 aggregated over 4:4 cost, request by request: 1 met both only under "
        "kvrouter 8 aggregated (4:4 cost: no answer on 1), 0 only under 4:4 cost"
    )
    runs[2].outcomes = agg
    assert explain(table, runs, DEFAULT_SLO).endswith(
        "the same requests met both objectives under each"
    )
    assert explain(table[2:], runs[2:], DEFAULT_SLO) == ""  # nothing to explain against


def test_a_burst_placed_while_prompts_prefill_spreads_over_the_decode_engines() -> None:
    # eight unrelated prompts at once: every pick is made before any prefill answers, so only
    # the decode legs held from the pick on tell one placement what the others took
    burst = [_req(0.0, [70_000 + 100 * i + k for k in range(8)]) for i in range(8)]
    fleet = VirtualFleet(workers=3, block_size=BS, gpu_blocks=2048, prefill=1)
    run = run_virtual(burst, "kvrouter", fleet, trace_block=TB, settings=_settings("always"))
    assert run.extra["remote_%"] == 100.0
    assert sorted(o.worker for o in run.outcomes) == ["w1"] * 4 + ["w2"] * 4


def test_the_request_dump_says_where_each_request_went_and_how_it_fared(tmp_path: Path) -> None:
    """``--dump-requests``: one line per request of the run, its decision (a remote one names its
    prefill engine, never the decode engine), and the times the table's columns are made of."""
    trace = _trace_file(tmp_path)
    dump, out = tmp_path / "d" / "requests.jsonl", tmp_path / "pd.json"
    argv = ["--trace", str(trace), "--trace-block", str(TB), "--gpu-blocks", "2048", "--pd",
            "1:2", "--pd-mode", "threshold", "--start", "2", "--no-progress", "--json", str(out), "--dump-requests",
            str(dump)]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(x) for x in dump.read_text().splitlines()]
    (row,) = json.loads(out.read_text())["table"]
    assert [x["record"] for x in lines] == list(range(2, 12))
    assert {x["policy"] for x in lines} == {row["policy"]}
    remote = [x for x in lines if x["pd"] == "remote"]
    assert len(remote) == round(row["remote_%"] / 10) and 0 < len(remote) < 10, lines
    assert all(x["pd"] in ("local", "remote") and x["error"] is None for x in lines)
    for x in lines:
        assert (x["prefill_worker"] is not None) == (x["pd"] == "remote")
        assert x["prefill_worker"] != x["worker"] and x["output_tokens"] == 8
        assert x["e2e_ms"] > x["ttft_ms"] > 0
        assert x["tpot_ms"] == pytest.approx((x["e2e_ms"] - x["ttft_ms"]) / 7, abs=0.01)
    tpots = sorted(x["tpot_ms"] for x in lines)
    assert row["tpot_p99_ms"] == pytest.approx(tpots[-1], abs=0.06)  # (p99 of 10: the worst)
