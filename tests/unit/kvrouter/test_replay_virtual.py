"""Virtual-time replay: the ideal against a hand count, a placement whose answer is known by hand,
a fleet that can hold everything reaching the ideal exactly, determinism, and the CLI's table,
JSON, plots and errors (the report's own: test_replay_report.py; the plots': test_replay_plots.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrouter.replay.cli import main
from kvrouter.replay.trace import (
    SharedPrefixSpec,
    TraceError,
    TraceRequest,
    block_tokens,
    ideal_hit,
    load_mooncake,
    pooled_lru_hit,
    prompt_tokens,
    shared_prefix,
)
from kvrouter.replay.virtual import VirtualFleet, run_virtual

TB = 64  # trace block (tokens) in these tests: small traces, same rules as 512
FLEET = VirtualFleet(workers=2, block_size=16, gpu_blocks=512)


def _req(t: float, ids: list[int], n: int | None = None, out: int = 4) -> TraceRequest:
    return TraceRequest(t, tuple(ids), n if n is not None else len(ids) * TB, out)


def _write(path: Path, reqs: list[TraceRequest]) -> Path:
    with open(path, "w") as f:
        for r in reqs:
            row = {
                "timestamp": int(r.arrival_s * 1000),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")
    return path


def test_ideal_is_the_leading_run_seen_before() -> None:
    reqs = [
        _req(0, [1, 2, 3]),  # nothing seen: 0
        _req(1, [1, 2, 4]),  # 1, 2 seen: 128
        _req(2, [1, 5], n=100),  # 1 seen, capped by the prompt: 64
        _req(3, [6, 2]),  # 6 unseen: the run stops there, 2 does not count: 0
        _req(4, [1, 2, 3], n=150),  # all three seen, capped: 150
    ]
    total = 192 + 192 + 100 + 128 + 150
    assert ideal_hit(reqs, TB) == pytest.approx((128 + 64 + 150) / total)


def test_equal_ids_give_equal_tokens_and_different_ids_differ() -> None:
    assert block_tokens(7, 64) == block_tokens(7, 64) and len(block_tokens(7, 64)) == 64
    assert block_tokens(7, 64)[:16] != block_tokens(8, 64)[:16]  # the first engine block differs
    assert block_tokens(7, 64)[16:32] != block_tokens(2**20 + 7, 64)[16:32]
    r = _req(0, [3, 4], n=100)
    toks = prompt_tokens(r, TB)
    assert len(toks) == 100 and toks[:64] == block_tokens(3, 64)


def test_one_worker_with_room_for_everything_reaches_the_ideal_exactly() -> None:
    # spaced arrivals: each request is done before the next, so only the cache decides
    reqs = [_req(0, [1, 2, 3]), _req(10, [1, 2, 4]), _req(20, [1, 5]), _req(30, [1, 2, 3, 6])]
    run = run_virtual(reqs, "round_robin", VirtualFleet(workers=1, gpu_blocks=512), trace_block=TB)
    cached = [o.cached_tokens for o in run.outcomes]
    assert cached == [0, 128, 64, 192]
    hit = sum(cached) / sum(o.prompt_tokens for o in run.outcomes)
    assert hit == pytest.approx(ideal_hit(reqs, TB))


def _crossed() -> list[TraceRequest]:
    """Two conversations; their second turns come back in the other order, so alternating
    placement sends each to the worker without its prefix."""
    a, b = [1, 2, 3, 4], [10, 11, 12, 13]
    return [_req(0, a), _req(0.01, b), _req(5, [*b, 14]), _req(5.01, [*a, 5])]


@pytest.mark.parametrize("policy", ["kvrouter", "oracle"])
def test_follow_ups_go_where_their_prefix_is(policy: str) -> None:
    run = run_virtual(_crossed(), policy, FLEET, trace_block=TB)
    o = run.outcomes
    assert o[0].worker != o[1].worker  # two idle workers: the second conversation spreads
    assert (o[2].worker, o[3].worker) == (o[1].worker, o[0].worker)
    assert [x.cached_tokens for x in o] == [0, 0, 256, 256]


def test_round_robin_misses_them() -> None:
    run = run_virtual(_crossed(), "round_robin", FLEET, trace_block=TB)
    assert [o.worker for o in run.outcomes] == ["w0", "w1", "w0", "w1"]
    assert [o.cached_tokens for o in run.outcomes] == [0, 0, 0, 0]


def test_times_are_the_models() -> None:
    """One request alone: TTFT is one prefill step, e2e adds a decode step per further token."""
    run = run_virtual([_req(0, [1, 2], out=3)], "round_robin", FLEET, trace_block=TB)
    o = run.outcomes[0]
    prefill = (2e-6 * 128**2 + 0.03 * 128 + 4.0) / 1e3
    assert o.ttft_s == pytest.approx(prefill)
    decode = [(8.0 + 0.15 + 2e-5 * (128 + k)) / 1e3 for k in (1, 2)]
    assert o.e2e_s == pytest.approx(prefill + sum(decode))
    assert run.sim_s == pytest.approx(o.e2e_s)


def _table(tmp_path: Path, trace: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    args = ["--trace", str(trace), "--trace-block", str(TB), "--workers", "2"]
    args += ["--gpu-blocks", "256", "--json", str(out), "--no-progress", *extra]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_same_seed_same_table_and_every_policy_reported(tmp_path: Path, capsys) -> None:
    spec = SharedPrefixSpec(groups=3, prompts=6, system_len=256, question_len=64, turns=2,
                            output_len=8, rate=20, think_s=0.5, seed=3)  # fmt: skip
    trace = _write(tmp_path / "t.jsonl", shared_prefix(spec, TB))
    first = _table(tmp_path, trace, "a", "--plots", str(tmp_path / "plots"))
    second = _table(tmp_path, trace, "b")
    assert first["table"] == second["table"]
    policies = [r["policy"] for r in first["table"]]
    assert policies == [
        "random",
        "round_robin",
        "least_load",
        "kvrouter",
        "cache_aware",
        "smg",
        "oracle",
    ]
    assert all(r["ok"] == 36 and r["errors"] == 0 for r in first["table"])
    assert first["ideal"] == pytest.approx(ideal_hit(load_mooncake(trace), TB))
    by = {r["policy"]: r for r in first["table"]}
    assert by["kvrouter"]["hit_%"] > by["round_robin"]["hit_%"]
    for name in ("ttft_cdf.png", "hit_rate.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "infinite-cache ideal" in printed and "oracle" in printed


def test_config_weights_reach_the_kvrouter_policy(tmp_path: Path, capsys) -> None:
    # A's follow-up arrives while A still decodes on its worker and the other worker is idle
    reqs = [_req(0, [1, 2, 3, 4], out=200), _req(0.01, [10], out=1), _req(0.5, [1, 2, 3, 4, 5])]
    trace = _write(tmp_path / "t.jsonl", reqs)
    cfg = tmp_path / "router.yaml"
    cfg.write_text("scoring:\n  overlap_weight: 0\n")  # prefix counts for nothing: load decides
    by_load = _table(tmp_path, trace, "w0", "--policies", "kvrouter", "--config", str(cfg))
    default = _table(tmp_path, trace, "w1", "--policies", "kvrouter")
    assert by_load["table"][0]["hit_%"] == 0.0 < default["table"][0]["hit_%"]
    cfg.write_text("scoring:\n  overlap_weigth: 1\n")
    assert main(["--trace", str(trace), "--config", str(cfg), "--no-progress"]) == 2
    assert "overlap_weigth" in capsys.readouterr().err


def test_bad_inputs_are_named(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{}\n')
    assert main(["--trace", str(bad), "--trace-block", "16", "--no-progress"]) == 2
    assert "bad.jsonl:2: not a Mooncake record" in capsys.readouterr().err
    good = _write(tmp_path / "g.jsonl", _crossed())
    assert main(["--trace", str(good), "--trace-block", "24", "--no-progress"]) == 2
    assert "multiple of the engine block size" in capsys.readouterr().err
    assert main(["--trace", str(good), "--policies", "sglang", "--no-progress"]) == 2
    assert "unknown virtual-time policy 'sglang'" in capsys.readouterr().err
    assert main(["--no-progress"]) == 2
    assert "give --trace" in capsys.readouterr().err
    assert main(["--trace", str(good), "--arrival-spread-ms", "-1", "--no-progress"]) == 2
    assert "--arrival-spread-ms must not be negative" in capsys.readouterr().err
    with pytest.raises(TraceError, match="no records"):
        load_mooncake(good, start=10)


def test_pooled_lru_forgets_what_it_had_no_room_for() -> None:
    reqs = [_req(0, [1, 2], out=1), _req(1, [3, 4], out=1), _req(2, [1, 2], out=1)]
    total = 3 * 128
    # room for everything (answers take a block each): the third request hits its two blocks
    assert pooled_lru_hit(reqs, TB, 6 * TB) == pytest.approx(128 / total) == ideal_hit(reqs, TB)
    # room for 4 blocks: [1, 2] were evicted by [3, 4] and the answers
    assert pooled_lru_hit(reqs, TB, 4 * TB) == 0.0


def test_error_kinds_say_what_failed_most_often_first() -> None:
    from types import SimpleNamespace

    from kvrouter.replay.live_client import LiveOutcome
    from kvrouter.replay.report import error_kinds

    outs = [LiveOutcome(i) for i in range(6)]
    outs[1].error = "HTTP 504: worker timed out"
    outs[2].error = "HTTP 502: worker failed"
    outs[3].error = "HTTP 504: worker timed out"
    run = SimpleNamespace(policy="kvrouter", outcomes=outs, engines=[])
    assert error_kinds(run) == {"HTTP 504: worker timed out": 2, "HTTP 502: worker failed": 1}
    assert list(error_kinds(run, limit=1)) == ["HTTP 504: worker timed out"]


def test_requests_sharing_a_timestamp_can_be_spread_over_the_trace_s_step() -> None:
    from kvrouter.replay.trace import TraceRequest, spread_ties

    reqs = [TraceRequest(t, (i,), 64, 1) for i, t in enumerate((0.0, 0.0, 0.0, 3.0, 3.0, 4.0))]
    out = spread_ties(reqs, 3.0)
    assert [(r.arrival_s, r.hash_ids[0]) for r in out] == [
        (0.0, 0),
        (1.0, 1),
        (2.0, 2),
        (3.0, 3),
        (4.0, 5),  # a later timestamp's request keeps its time; arrivals stay in order
        (4.5, 4),
    ]
    assert spread_ties(reqs, 0.0) == reqs


def test_a_rate_scale_brings_arrivals_closer_and_keeps_the_requests() -> None:
    from kvrouter.replay.trace import TraceError, TraceRequest, scale_rate

    reqs = [TraceRequest(t, (i,), 64 + i, 2) for i, t in enumerate((0.0, 3.0, 3.0, 7.5))]
    out = scale_rate(reqs, 3.0)
    assert [r.arrival_s for r in out] == [0.0, 1.0, 1.0, 2.5]
    assert [(r.hash_ids, r.input_length, r.output_length) for r in out] == [
        (r.hash_ids, r.input_length, r.output_length) for r in reqs
    ]
    assert scale_rate(reqs, 1.0) == reqs
    with pytest.raises(TraceError, match="--rate-scale must be positive"):
        scale_rate(reqs, 0.0)
