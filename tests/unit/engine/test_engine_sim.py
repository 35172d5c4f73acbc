"""The sim runner: its timing model, option handling, and the KV self-check that makes engine bugs
(a lost, misplaced or wrongly loaded block) fail loudly."""

from __future__ import annotations

import pytest

from engine.runner import RunnerError, make_runner
from engine.runner.base import RunnerConfig, SamplingParams, ScheduledSeq
from engine.runner.sim import SimRunner


def _sim(**options: str) -> SimRunner:
    r = make_runner("sim", RunnerConfig(16, 8, 4, speedup=1e6, options=options))
    assert isinstance(r, SimRunner)
    return r


def test_timing_model() -> None:
    sim = _sim(
        prefill_a="0.001",
        prefill_b="0.5",
        prefill_c="3",
        decode_d0="7",
        decode_d1="0.5",
        decode_d2="0.01",
    )
    assert sim.prefill_ms(100) == pytest.approx(0.001 * 100**2 + 0.5 * 100 + 3)
    assert sim.prefill_ms([10, 20]) == pytest.approx(0.001 * 500 + 0.5 * 30 + 3)
    assert sim.decode_ms(4) == pytest.approx(9.0)
    assert sim.decode_ms(4, context=1000) == pytest.approx(9.0 + 10.0)  # the KV read per token
    bytes_per_block = 12288 * 16
    assert sim.copy_s(2) == pytest.approx(2 * bytes_per_block / 25e9 + 0.01e-3)
    assert sim.io_delay("DISK", 3 * sim.kv_block_bytes) == pytest.approx(sim.copy_s(3, "DISK"))
    assert sim.io_delay("DISK", sim.kv_block_bytes, write=True) == 0.0
    # a step's modeled time: prefill of 20 tokens plus a decode of one other sequence
    a = ScheduledSeq(1, list(range(20)), 0, 20, [0, 1], sample=True)
    b = ScheduledSeq(2, list(range(5)), 4, 1, [2], sample=True, num_output_tokens=1)
    sim.execute([ScheduledSeq(2, list(range(4)), 0, 4, [2], sample=False)])
    out = sim.execute([a, b])
    # b decodes its 5th position attending to 5 tokens
    assert out.elapsed_s == pytest.approx((sim.prefill_ms(20) + sim.decode_ms(1, 5)) / 1e3)
    assert set(out.tokens) == {1, 2} and all(32 <= t <= 126 for t in out.tokens.values())


def test_timing_only_models_the_same_time_without_payloads() -> None:
    cfg = RunnerConfig(block_size=16, num_gpu_blocks=8, num_host_slots=0)
    full, timed = SimRunner(cfg), SimRunner(cfg, timing_only=True)
    a = ScheduledSeq(1, list(range(20)), 0, 20, [0, 1], sample=True)
    b = ScheduledSeq(2, list(range(5)), 4, 1, [2], sample=True, num_output_tokens=1)
    full.execute([ScheduledSeq(2, list(range(4)), 0, 4, [2], sample=False)])
    want = full.execute([a, b])
    got = timed.execute([a, b])  # b's blocks were never written: only the full runner checks
    assert got.elapsed_s == want.elapsed_s
    assert set(got.tokens) == {1, 2} and all(32 <= t <= 126 for t in got.tokens.values())
    assert timed.execute([a, b]).tokens == got.tokens  # deterministic


def test_a_live_step_lasts_its_modeled_time_whatever_its_checks_took() -> None:
    # the clock is injected (the one seam here): the checks "take" 3 ms of a 10 ms step at
    # speedup 2 (5 ms of wall time), so the step waits the 2 ms left, not 5 on top of them
    sim = SimRunner(
        RunnerConfig(
            16, 8, 0, speedup=2.0, options={"prefill_a": "0", "prefill_b": "0", "prefill_c": "10"}
        )
    )
    now, slept = [0.0], []

    def clock() -> float:
        now[0] += 0.003  # read at the step's start and after its checks: 3 ms between
        return now[0]

    sim.clock, sim.sleep = clock, slept.append
    out = sim.execute([ScheduledSeq(1, list(range(20)), 0, 20, [0, 1], sample=True)])
    assert out.elapsed_s == pytest.approx(0.010) and slept == [pytest.approx(0.002)]
    # checks slower than the step: no wait at all (the step is as long as its work)
    now[0], slept[:] = 0.0, []

    def slow_clock() -> float:
        now[0] += 0.006
        return now[0]

    sim.clock = slow_clock
    sim.execute([ScheduledSeq(2, list(range(20)), 0, 20, [2, 3], sample=True)])
    assert slept == []


def test_options_are_checked() -> None:
    with pytest.raises(RunnerError, match="unknown sim runner option"):
        _sim(prefil_a="1")
    with pytest.raises(RunnerError, match="must be a number"):
        _sim(prefill_a="fast")
    with pytest.raises(RunnerError, match="unknown runner"):
        make_runner("tpu", RunnerConfig(16, 8, 4))


def test_greedy_is_a_function_of_the_context_and_seeds_reproduce() -> None:
    sim = _sim()
    toks = list(range(40, 70))

    def first(seq_id: int, sp: SamplingParams) -> int:
        return sim.execute([ScheduledSeq(seq_id, toks, 0, 30, [0, 1], sp)]).tokens[seq_id]

    assert first(1, SamplingParams()) == first(2, SamplingParams())
    seeded = SamplingParams(temperature=1.0, seed=7)
    assert first(3, seeded) == first(4, seeded)


def test_the_kv_check_catches_a_wrong_block() -> None:
    sim = _sim()
    toks = list(range(40, 80))
    sim.execute([ScheduledSeq(1, toks, 0, 32, [0, 1], sample=False)])
    # attending to a block that never received this prefix's KV
    with pytest.raises(RunnerError, match="KV check failed"):
        sim.execute([ScheduledSeq(2, toks, 32, 8, [0, 5, 2])])
    # a round trip through the host pool keeps the bytes: load block 1 back into block 6
    sim.swap_out([(1, 0)]).wait()
    sim.write_host(1, sim.read_host(0))
    sim.swap_in([(1, 6)]).wait()
    assert sim.execute([ScheduledSeq(3, toks, 32, 8, [0, 6, 3])]).tokens
    with pytest.raises(RunnerError, match="not a sim KV block"):
        sim.write_host(2, b"junk")
    with pytest.raises(RunnerError, match="out of range"):
        sim.swap_in([(0, 99)])
