"""smg 1.13's cache_aware, emulated in virtual time: its affinity, its count-pressure gate, its
expected wait with the since-poll credit, the overload veto of a load report, the polls the run
gives it; and the replay's cache-pressure options (``--kv-tokens``, the pooled-LRU share)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.engine import LLMEngine
from engine.sequence import Request
from kvrouter.replay.cli import main
from kvrouter.replay.smg import SmgPolicy
from kvrouter.replay.trace import TraceRequest, pooled_lru_hit
from kvrouter.replay.virtual import VirtualFleet, _engine, _Sim, run_virtual

TB = 64
FLEET = VirtualFleet(workers=2, block_size=16, gpu_blocks=512)


def _req(t: float, ids: list[int], out: int = 4) -> TraceRequest:
    return TraceRequest(t, tuple(ids), len(ids) * TB, out)


def _crossed() -> list[TraceRequest]:
    """Two conversations whose second turns come back in the other order."""
    a, b = [1, 2, 3, 4], [10, 11, 12, 13]
    return [_req(0, a), _req(0.01, b), _req(5, [*b, 14]), _req(5.01, [*a, 5])]


@pytest.mark.parametrize("policy", ["smg", "smg_dark"])
def test_follow_ups_go_where_their_prefix_was_routed(policy: str) -> None:
    run = run_virtual(_crossed(), policy, FLEET, trace_block=TB)
    o = run.outcomes
    # the second first turn: the first's worker has a dispatch credited (smg) or in flight
    assert o[0].worker != o[1].worker
    assert (o[2].worker, o[3].worker) == (o[1].worker, o[0].worker)  # 4 of 5 blocks: > 30 %
    assert [x.cached_tokens for x in o] == [0, 0, 256, 256]


def test_polls_come_every_ten_seconds_and_do_not_end_the_run() -> None:
    reqs = [_req(0, [1, 2]), _req(25, [3, 4])]
    sim = _Sim(reqs, "smg", FLEET, TB, None, 0, None)
    polls: list[float] = []
    poll = sim.policy.poll
    sim.policy.poll = lambda now: (polls.append(now), poll(now))[1]  # type: ignore[method-assign]
    end = sim.run()
    # at 30 s nothing else is left to happen: no poll after it
    assert polls == [0.0, 10.0, 20.0, 30.0]
    assert end == pytest.approx(
        max(r.arrival_s + (o.e2e_s or 0) for r, o in zip(reqs, sim.outcomes))
    )
    assert end < 26


def _engines(n: int = 2) -> list[LLMEngine]:
    return [_engine(FLEET, 0) for _ in range(n)]


def _queue(engine: LLMEngine, k: int) -> None:
    for i in range(k):
        engine.add_request(Request(f"q{i}", list(range(100 * i, 100 * i + 64)), 4))


def test_the_count_pressure_gate() -> None:
    p = SmgPolicy(_engines(), seed=0)
    # mean 4: margin max(⌈2·√4⌉, 4) = 4, so above 6 and above 8
    assert p._over_gate(9, 4.0) and not p._over_gate(8, 4.0)
    # mean 100: margin min(64, 20) = 20, so above 150 and above 120
    assert p._over_gate(151, 100.0) and not p._over_gate(150, 100.0)


def test_expected_wait_reads_the_report_and_credits_each_dispatch() -> None:
    engines = _engines()
    _queue(engines[0], 2)
    p = SmgPolicy(engines, seed=0)
    p.poll(0.0)
    # two waiting requests at p̄ = 1024 tokens over the default 2,000 tok/s; no KV in use yet
    assert p._score(0) == pytest.approx(2 * 1024 / 2000)
    assert p._score(1) == 0.0
    assert p._expected_wait([0, 1]) == 1
    assert p._score(1) == pytest.approx(1024 / 2000)  # credited until the next poll
    p.poll(10.0)
    assert p._score(1) == 0.0


def test_an_overloaded_report_takes_a_holder_out_until_the_next_poll() -> None:
    engines = _engines()
    p = SmgPolicy(engines, seed=0)
    prompt = list(range(5000, 5000 + 8 * 16))
    assert p.choose(prompt, 0.0)[0] in (0, 1)
    holder = next(w for w, tree in enumerate(p.trees) if tree)
    assert p.choose(prompt, 0.0)[0] == holder  # a full match: affinity
    _queue(engines[holder], SmgPolicy.OVERLOAD_WAITING)
    p.poll(10.0)
    assert p.vetoed[holder]
    assert p.choose(prompt, 10.0)[0] == 1 - holder
    p.vetoed = [True, True]  # every worker vetoed: the least loaded, the policy bypassed
    p.outstanding = [3, 1]
    assert p.choose(list(range(9000, 9064)), 11.0) == (1, None)


def test_kv_tokens_sets_each_workers_cache_and_the_pooled_lru_share(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    reqs = [_req(0.5 * i, [100 * (i % 2) + k for k in range(6)]) for i in range(12)]
    trace.write_text(
        "".join(
            json.dumps({"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
            for r in reqs
        )
    )  # fmt: skip
    out = tmp_path / "o.json"
    args = ["--trace", str(trace), "--trace-block", str(TB), "--workers", "2", "--no-progress"]
    args += ["--kv-tokens", "512", "--policies", "round_robin,smg", "--json", str(out)]
    assert main(args) == 0
    got = json.loads(out.read_text())
    assert got["args"]["gpu_blocks"] == 32
    assert got["pooled_lru"] == pytest.approx(pooled_lru_hit(reqs, TB, 2 * 512))
    assert got["pooled_lru"] > 0
    for row in got["table"]:
        assert row["of_lru_%"] == pytest.approx(row["hit_%"] / got["pooled_lru"], abs=1)
    assert main([*args[:-2], "--kv-tokens", "500"]) == 2  # not whole blocks
