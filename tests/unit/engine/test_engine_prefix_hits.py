"""Prefix hits: a repeated prompt reports its full cached blocks as cached_tokens, and its sim time
to first token drops by what the timing model predicts (exactly in engine time, and on the wall
clock through the OpenAI server within a stated tolerance)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import openai
import pytest
from engine_helpers import BS, make_engine, prompt, run, serve

from engine.config import EngineConfig, ServerSettings
from engine.runner.base import RunnerConfig
from engine.runner.sim import SimRunner
from engine.server import create_app


def test_repeated_prompt_hits_its_full_blocks_and_ttft_drops_as_modeled() -> None:
    engine = make_engine()
    sim = engine.runner
    assert isinstance(sim, SimRunner)
    p = prompt(random.Random(1), 300)
    cold = run(engine, "cold", p)
    warm = run(engine, "warm", p)
    cached = (len(p) - 1) // BS * BS  # the last token is always computed
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == cached == 288
    assert cold.engine_ttft_s == pytest.approx(sim.prefill_ms(300) / 1e3, rel=1e-12)
    assert warm.engine_ttft_s == pytest.approx(sim.prefill_ms(300 - cached) / 1e3, rel=1e-12)
    # a prompt that shares only a prefix hits only the shared full blocks
    other = p[:100] + prompt(random.Random(2), 50)
    assert run(engine, "other", other).num_cached_tokens == 96


def test_load_back_ttft_adds_the_modeled_copy_time(tmp_path: Path) -> None:
    engine = make_engine(num_gpu_blocks=8, num_cpu_blocks=16, offload="write-back")
    sim = engine.runner
    assert isinstance(sim, SimRunner)
    rng = random.Random(4)
    p = prompt(rng, 4 * BS + 5)
    run(engine, "p", p)
    run(engine, "evict", prompt(rng, 8 * BS - 1))  # takes every GPU block: p goes to CPU_PINNED
    assert not set(engine.bm.hash_blocks_of(p)) & engine.block_listing()["GPU"]
    warm = run(engine, "p2", p)
    assert warm.num_cached_tokens == 4 * BS
    assert engine.tiers.loaded_blocks["CPU_PINNED"] == 4
    expected = sim.copy_s(4) + sim.prefill_ms(5) / 1e3
    assert warm.engine_ttft_s == pytest.approx(expected, rel=1e-12)


async def test_openai_client_sees_cached_tokens_and_the_wall_clock_ttft_drop() -> None:
    # prefill_b = 1 ms/token makes the modeled gap large against HTTP noise
    cfg = EngineConfig(speedup=1.0, runner_options={"prefill_b": "1.0"}, num_gpu_blocks=256)
    settings = ServerSettings(engine=cfg, events=None, replay=None)
    text = "".join(chr(c) for c in prompt(random.Random(3), 300))
    sim = SimRunner(RunnerConfig(16, 1, 0, options={"prefill_b": "1.0"}))  # the same model
    predicted = (sim.prefill_ms(300) - sim.prefill_ms(12)) / 1e3
    async with serve(create_app(settings)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        walls = []
        usages = []
        for _ in range(2):
            t0 = time.monotonic()
            r = await client.completions.create(
                model="kvrouter-sim", prompt=text, max_tokens=1, temperature=0
            )
            walls.append(time.monotonic() - t0)
            usages.append(r.usage)
        await client.close()
    assert usages[0] is not None and usages[1] is not None
    assert usages[0].prompt_tokens == 300
    assert usages[0].prompt_tokens_details is not None
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details is not None
    assert usages[1].prompt_tokens_details.cached_tokens == 288
    # tolerance: HTTP and scheduling noise on a shared machine, ~25% of the 288 ms predicted
    assert walls[0] - walls[1] == pytest.approx(predicted, abs=0.075)
