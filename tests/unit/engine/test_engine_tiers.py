"""Tier round trips: a prefix pushed GPU → CPU_PINNED → DISK comes back through load-back with its
events in order; EXTERNAL blocks stored by one engine are found by another on the same pool
(shared directory and a real Redis server)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import BS, make_engine, prompt, redis_server, run

from engine.engine import LLMEngine
from engine.sequence import Request
from indexer.events import BlockRemoved, BlockStored, Event


def _events_of(events: list[Event], h: int) -> list[str]:
    """The event history of one block: "+TIER" stored, "-TIER" removed."""
    out = []
    for ev in events:
        if isinstance(ev, BlockStored | BlockRemoved) and h in ev.block_hashes:
            out.append(("+" if isinstance(ev, BlockStored) else "-") + ev.tier)
    return out


def _serve(engine: LLMEngine, events: list[Event], rid: str, tokens: list[int]) -> int:
    out = run(engine, rid, tokens)
    engine.wait_transfers()
    events.extend(engine.drain_events())
    return int(out.num_cached_tokens)


def test_write_back_round_trip_gpu_cpu_disk_and_back(tmp_path: Path) -> None:
    engine = make_engine(
        num_gpu_blocks=6,
        num_cpu_blocks=4,
        disk_dir=str(tmp_path / "disk"),
        num_disk_blocks=64,
        offload="write-back",
    )
    rng = random.Random(3)
    events: list[Event] = []
    a = prompt(rng, 4 * BS + 1)  # 4 full blocks, all reusable
    assert _serve(engine, events, "a", a) == 0
    hashes = engine.bm.hash_blocks_of(a)[:4]
    assert engine.block_listing()["GPU"] >= set(hashes)
    i = 0
    while not set(hashes) <= engine.block_listing()["DISK"] or set(hashes) & (
        engine.block_listing()["GPU"] | engine.block_listing()["CPU_PINNED"]
    ):
        _serve(engine, events, f"filler{i}", prompt(rng, 4 * BS + 1))
        i += 1
        assert i < 20, "the prefix never reached DISK"
    # DISK files exist for exactly the listed blocks
    assert len(list((tmp_path / "disk").iterdir())) == len(engine.block_listing()["DISK"])

    assert _serve(engine, events, "a-again", a) == 4 * BS
    assert engine.tiers.loaded_blocks["DISK"] == 4
    assert set(hashes) <= engine.block_listing()["GPU"]
    for h in hashes:
        assert _events_of(events, h) == [
            "+GPU",
            "+CPU_PINNED",
            "-GPU",
            "+DISK",
            "-CPU_PINNED",
            "+GPU",
        ]


def test_write_through_copies_down_after_each_copy_completes(tmp_path: Path) -> None:
    engine = make_engine(
        num_gpu_blocks=32,
        num_cpu_blocks=8,
        disk_dir=str(tmp_path / "disk"),
        external_dir=str(tmp_path / "ext"),
        offload="write-through",
        speedup=1.0,  # real modeled copy times, so the CPU copy is visibly in flight
        runner_options={"cpu_gbps": "0.05"},  # ~40 ms per block
    )
    a = prompt(random.Random(5), 2 * BS + 1)
    engine.add_request(Request("a", a, max_tokens=1))
    assert engine.step()[0].finished  # one prefill step; the copies are still in flight
    # the GPU store is out, the lower tiers only after the copy's completion
    first = engine.drain_events()
    assert [e.tier for e in first if isinstance(e, BlockStored)] == ["GPU"]
    assert engine.block_listing()["CPU_PINNED"] == set()
    engine.wait_transfers()
    later = [e.tier for e in engine.drain_events() if isinstance(e, BlockStored)]
    assert later == ["CPU_PINNED", "DISK", "EXTERNAL"] * 2
    hashes = set(engine.bm.hash_blocks_of(a)[:2])
    for tier in ("GPU", "CPU_PINNED", "DISK", "EXTERNAL"):
        assert engine.block_listing()[tier] == hashes


@pytest.fixture(params=["dir", "redis"])
def pool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    if request.param == "dir":
        yield {"external_dir": str(tmp_path / "shared")}
    else:
        with redis_server(tmp_path) as url:
            yield {"external_url": url}


def test_external_blocks_of_one_engine_serve_another(pool: dict[str, str]) -> None:
    one = make_engine(num_gpu_blocks=32, **pool)
    two = make_engine(num_gpu_blocks=32, **pool)
    other_model = make_engine(num_gpu_blocks=32, model="another-model", **pool)
    try:
        p = prompt(random.Random(9), 5 * BS + 3)
        assert run(one, "p", p).num_cached_tokens == 0
        one.wait_transfers()
        stored = one.block_listing()["EXTERNAL"]
        assert len(stored) == 5

        out = run(two, "p", p)
        assert out.num_cached_tokens == 5 * BS
        assert two.tiers.loaded_blocks["EXTERNAL"] == 5
        ev = [e for e in two.drain_events() if isinstance(e, BlockStored) and e.tier == "GPU"]
        # the loaded blocks are announced on GPU under the same engine hashes
        assert stored <= {h for e in ev for h in e.block_hashes}

        # a different model never takes them (its keys differ)
        assert run(other_model, "p", p).num_cached_tokens == 0
        assert other_model.tiers.loaded_blocks["EXTERNAL"] == 0
    finally:
        for e in (one, two, other_model):
            e.close()


def test_unreachable_redis_is_a_clear_start_error() -> None:
    from engine.stores import TierError

    with pytest.raises(TierError, match="cannot reach"):
        make_engine(external_url="redis://127.0.0.1:1/0")
