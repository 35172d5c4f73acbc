"""Scheduler: token budget, chunked prefill, continuous batching, preemption by recompute, aborts."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import pytest
from engine_helpers import BS, prompt, run

from engine.config import EngineConfig
from engine.engine import InvalidRequestError, LLMEngine
from engine.runner.base import RunnerConfig, ScheduledSeq, StepOutput
from engine.runner.sim import SimRunner
from engine.sequence import Request


class RecordingSim(SimRunner):
    """The real sim runner, keeping what each step was asked to compute."""

    def __init__(self, config: RunnerConfig) -> None:
        super().__init__(config)
        self.steps: list[list[tuple[int, int, int, bool]]] = []

    def execute(self, seqs: Seq[ScheduledSeq]) -> StepOutput:
        self.steps.append(
            [(s.seq_id, s.num_computed_tokens, s.num_new_tokens, s.sample) for s in seqs]
        )
        return super().execute(seqs)


def _engine(**kw: object) -> tuple[LLMEngine, RecordingSim]:
    cfg = EngineConfig(speedup=1000.0, **kw)  # type: ignore[arg-type]
    sim = RecordingSim(
        RunnerConfig(cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks + 64, speedup=1000.0)
    )
    return LLMEngine(cfg, runner=sim), sim


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine, sim = _engine(max_num_batched_tokens=32)
    out = run(engine, "a", prompt(random.Random(1), 100), max_tokens=2)
    assert out.num_output_tokens == 2
    assert [s[0][1:] for s in sim.steps] == [
        (0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True), (100, 1, True),
    ]  # fmt: skip


def test_decodes_and_a_new_prefill_share_one_step() -> None:
    engine, sim = _engine(max_num_batched_tokens=40)
    rng = random.Random(2)
    engine.add_request(Request("a", prompt(rng, 20), max_tokens=5))
    engine.step()
    engine.add_request(Request("b", prompt(rng, 60), max_tokens=1))
    engine.step()
    # a decodes (1 token) and b prefills a chunk with the remaining budget
    assert sorted((new, sample) for _, _, new, sample in sim.steps[-1]) == [(1, True), (39, False)]
    engine.run_until_idle()
    assert all(sum(n for _, _, n, _ in step) <= 40 for step in sim.steps)


def test_preemption_by_recompute_gives_the_same_greedy_output() -> None:
    rng = random.Random(3)
    prompts = [prompt(rng, 40) for _ in range(3)]

    def serve(engine: LLMEngine) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"r{i}", p, max_tokens=40))
        outs: dict[str, list[int]] = {}
        for o in engine.run_until_idle():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return outs

    small, _ = _engine(num_gpu_blocks=12)  # 3 x 5 blocks at the end: someone must yield
    big, _ = _engine(num_gpu_blocks=64)
    got, want = serve(small), serve(big)
    assert small.scheduler.num_preemptions > 0 and big.scheduler.num_preemptions == 0
    assert got == want and all(len(v) == 40 for v in got.values())
    assert small.bm.num_free_blocks == 12  # everything released


def test_max_num_seqs_limits_the_running_batch() -> None:
    engine, sim = _engine(max_num_seqs=2)
    rng = random.Random(4)
    for i in range(5):
        engine.add_request(Request(f"r{i}", prompt(rng, 10), max_tokens=3))
    engine.run_until_idle()
    assert max(len(step) for step in sim.steps) == 2


def test_abort_releases_the_blocks_of_running_and_waiting_sequences() -> None:
    engine, _ = _engine(num_gpu_blocks=16, max_num_seqs=1)
    rng = random.Random(5)
    engine.add_request(Request("run", prompt(rng, 50), max_tokens=100))
    engine.add_request(Request("wait", prompt(rng, 50), max_tokens=100))
    engine.step()
    assert engine.bm.num_free_blocks < 16
    assert engine.abort("run") and engine.abort("wait") and not engine.abort("unknown")
    assert engine.bm.num_free_blocks == 16
    assert not engine.has_work


def test_requests_the_cache_cannot_hold_are_rejected() -> None:
    engine, _ = _engine(num_gpu_blocks=4)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        engine.add_request(Request("long", [65] * 60, max_tokens=5))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(Request("empty", [], max_tokens=5))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request(Request("bad", [1, 1 << 40], max_tokens=5))
    assert run(engine, "fits", [65] * (4 * BS - 5), max_tokens=5).num_output_tokens == 5
