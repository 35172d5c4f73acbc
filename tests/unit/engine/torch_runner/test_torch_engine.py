"""The engine core driving the torch runner: real KV through the prefix cache, every tier's
load-back, a shared EXTERNAL pool and preemption — greedy outputs must equal those of an engine
without prefix caching (exact token equality)."""

from __future__ import annotations

import pytest
from torch_helpers import DEVICE, TINY, prompt

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sequence import Request

BLOCK = 4
MAX_TOKENS = 6


def _engine(tmp_path, **kw) -> LLMEngine:
    cfg = dict(
        runner="torch",
        model=TINY,
        # float32 on every device: outputs are compared token for token
        runner_options={"device": DEVICE, "dtype": "float32"},
        block_size=BLOCK,
        num_gpu_blocks=64,
        max_num_batched_tokens=64,
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def _run(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
    """request id -> (generated tokens, cached prompt tokens), all requests submitted at once."""
    for rid, ids in prompts.items():
        engine.add_request(Request(rid, ids, MAX_TOKENS, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    for out in engine.run_until_idle():
        got[out.request_id].extend(out.new_token_ids)
        cached[out.request_id] = out.num_cached_tokens
    return {rid: (got[rid], cached[rid]) for rid in prompts}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy outputs without any caching, one request at a time."""
    engine = _engine(tmp_path_factory.mktemp("ref"), enable_prefix_caching=False)
    prompts = {f"p{i}": prompt(18 + 3 * i, seed=100 + i) for i in range(8)}
    out = {rid: _run(engine, {rid: ids})[rid][0] for rid, ids in prompts.items()}
    engine.close()
    return prompts, out


def test_prefix_hits_and_load_back_from_every_tier_reproduce_uncached_outputs(tmp_path, reference):
    prompts, ref = reference
    shared = tmp_path / "external"
    engine = _engine(
        tmp_path,
        num_gpu_blocks=24,
        num_cpu_blocks=6,
        disk_dir=str(tmp_path / "disk"),
        num_disk_blocks=12,
        external_dir=str(shared),
    )
    first = _run(engine, {"p0": prompts["p0"]})["p0"]
    assert first == (ref["p0"], 0)
    p0_blocks = set(engine.block_listing()["GPU"])
    again = _run(engine, {"p0b": prompts["p0"]})["p0b"]
    # every full block but the one holding the last prompt token (it must be computed)
    assert again == (ref["p0"], (len(prompts["p0"]) - 1) // BLOCK * BLOCK)
    # other prompts push p0's blocks out of the 24-block GPU pool into the lower tiers
    for rid in ("p1", "p2", "p3", "p4"):
        assert _run(engine, {rid: prompts[rid]})[rid][0] == ref[rid]
    listing = engine.block_listing()
    assert not p0_blocks & listing["GPU"]
    lower = listing["CPU_PINNED"] | listing["DISK"] | listing["EXTERNAL"]
    assert p0_blocks & lower
    back = _run(engine, {"p0c": prompts["p0"]})["p0c"]
    assert back[0] == ref["p0"] and back[1] > 0
    assert engine.stats().tier_errors == 0
    engine.close()

    # a second engine on the same EXTERNAL directory loads p0's prefix from there
    other = _engine(tmp_path, num_gpu_blocks=24, external_dir=str(shared))
    got = _run(other, {"p0d": prompts["p0"]})["p0d"]
    assert got[0] == ref["p0"] and got[1] > 0
    other.close()


def test_preemption_by_recompute_reproduces_uncached_outputs(tmp_path, reference):
    prompts, ref = reference
    # p0 (5 blocks) and p1 (6) fill an 11-block pool at admission; decoding needs more blocks, so
    # the scheduler preempts and later recomputes
    engine = _engine(tmp_path, num_gpu_blocks=11)
    some = {rid: prompts[rid] for rid in ("p0", "p1", "p2", "p3")}
    out = _run(engine, some)
    assert engine.stats().preemptions > 0
    assert {rid: toks for rid, (toks, _) in out.items()} == {rid: ref[rid] for rid in some}
    engine.close()
