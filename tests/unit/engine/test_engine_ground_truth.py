"""The contract with the router: the events an engine publishes, received over ZMQ, decoded by
the wire decoder and applied to the indexer's PrefixIndex, reproduce exactly the engine's own
block listing on every tier — after a random workload that evicts from all four tiers."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import BS, Collector, connected, index_of, make_engine, redis_server

from engine.engine import LLMEngine
from engine.publisher import EventPublisher
from engine.sequence import Request
from indexer.events import CANONICAL_TIERS, AllBlocksCleared, BlockRemoved, BlockStored

TIERS = CANONICAL_TIERS  # what the engine publishes: the indexer's one tier list


@pytest.fixture(params=["dir", "redis"])
def external(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    if request.param == "dir":
        yield {"external_dir": str(tmp_path / "ext")}
    else:
        with redis_server(tmp_path) as url:
            yield {"external_url": url}


def _pump(engine: LLMEngine, pub: EventPublisher) -> None:
    while engine.has_work:
        engine.step()
        pub.publish(engine.drain_events())
        if not engine.scheduler.running:
            engine.wait_transfers()
    pub.publish(engine.drain_events())


def _check(engine: LLMEngine, pub: EventPublisher, col: Collector) -> dict[str, set[int]]:
    col.until_seq(pub.next_seq - 1)
    idx = index_of(col.batches)
    got = idx.engine_blocks(("w", 0))
    listing = engine.block_listing()
    for tier in TIERS:
        assert got.get(tier, set()) == listing[tier], f"{tier} differs"
    stats = idx.worker_stats(("w", 0))
    assert stats.orphans == 0 and stats.unknown_removals == 0
    return listing


@pytest.mark.parametrize("offload", ["write-through", "write-back"])
def test_published_events_rebuild_the_engine_listing(
    offload: str, external: dict[str, str], tmp_path: Path
) -> None:
    engine = make_engine(
        num_gpu_blocks=16,
        num_cpu_blocks=24,
        disk_dir=str(tmp_path / "disk"),
        num_disk_blocks=40,
        num_external_blocks=60,
        offload=offload,
        max_num_batched_tokens=96,
        max_num_seqs=4,
        **external,
    )
    pub = EventPublisher("tcp://127.0.0.1:0", None, topic="kv")
    col = Collector(pub.endpoint)
    try:
        # the engine is empty, so "cleared" is a truthful probe while the SUB joins
        connected(pub, col, lambda: pub.publish([AllBlocksCleared()]))
        rng = random.Random(7)
        bases = [[rng.randrange(32, 127) for _ in range(rng.randrange(40, 150))] for _ in range(8)]
        for i in range(60):
            base = bases[rng.randrange(len(bases))]
            cut = rng.randrange(len(base) // 2, len(base) + 1)
            tokens = base[:cut] + [rng.randrange(32, 127) for _ in range(rng.randrange(0, 40))]
            engine.add_request(Request(f"r{i}", tokens, max_tokens=rng.randrange(1, 24)))
            if rng.random() < 0.4:
                _pump(engine, pub)
            if i % 15 == 14:
                _pump(engine, pub)
                _check(engine, pub, col)
        _pump(engine, pub)
        listing = _check(engine, pub, col)
    finally:
        col.close()
        pub.close()
        engine.close()

    stored: Counter[str] = Counter()
    removed: Counter[str] = Counter()
    for b in col.batches:
        for ev in b.events:
            if isinstance(ev, BlockStored):
                stored[ev.tier] += len(ev.block_hashes)
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                removed[ev.tier] += len(ev.block_hashes)
    for tier in TIERS:
        assert listing[tier], f"nothing left on {tier}"
        assert removed[tier] > 0, f"no eviction from {tier}"
    # the workload really loaded blocks back from every lower tier
    assert all(n > 0 for n in engine.tiers.loaded_blocks.values()), engine.tiers.loaded_blocks
    assert [b.seq for b in col.batches] == list(range(col.batches[0].seq, pub.next_seq))


def test_reset_prefix_cache_publishes_all_blocks_cleared(tmp_path: Path) -> None:
    engine = make_engine(
        num_gpu_blocks=16, num_cpu_blocks=8, disk_dir=str(tmp_path / "d"), num_disk_blocks=8,
        external_dir=str(tmp_path / "e"),
    )  # fmt: skip
    pub = EventPublisher("tcp://127.0.0.1:0", None)
    col = Collector(pub.endpoint)
    try:
        connected(pub, col, lambda: pub.publish([AllBlocksCleared()]))
        rng = random.Random(1)
        for i in range(6):
            engine.add_request(Request(f"r{i}", [rng.randrange(32, 127) for _ in range(70)], 4))
        _pump(engine, pub)
        assert all(_check(engine, pub, col)[t] for t in TIERS)
        engine.reset_prefix_cache()
        pub.publish(engine.drain_events())
        assert not any(_check(engine, pub, col).values())
        assert isinstance(col.batches[-1].events[-1], AllBlocksCleared)
        assert not list((tmp_path / "d").iterdir())  # the DISK files are gone too
    finally:
        col.close()
        pub.close()
        engine.close()
