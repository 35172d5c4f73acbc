"""Each worker rank's entries are capped (issue 21, item 5): at its KV capacity times a margin
when the worker reported it, else at a default per rank. Past its cap a rank loses its own least
recently used (stored or matched) entries, counted and warned about once, while the other ranks'
events apply as before; over real ZMQ publishers and the real subscriber, then the index alone
for the rules (defaults, tiers without a size, re-chunked ranks)."""

from __future__ import annotations

import logging
import random

import pytest
import zmq.asyncio

from indexer.events import BlockRemoved, BlockStored
from indexer.index import PrefixIndex
from tests.unit.indexer.conftest import caught_up, endpoint, started
from tests.unit.indexer.kv_publisher import BLOCK, EventPublisher
from tests.waiting import wait_for

FLOOD, OTHER = ("w0", 0), ("w1", 0)


def chain(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n * BLOCK)]


def held(index: PrefixIndex, key: tuple[str, int]) -> int:
    return sum(index.worker_stats(key).blocks_by_tier.values())


async def test_a_rank_past_its_capacity_loses_its_least_recently_used_entries(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvrouter.index")
    flood, other = EventPublisher(ctx), EventPublisher(ctx)
    pubs += [flood, other]
    index = PrefixIndex(BLOCK)
    index.set_rank_caps(0, margin=1.25)  # no default: only a known capacity caps a rank
    sub = await started(index, ctx)
    rng = random.Random(5)
    hot, cold = chain(rng, 4), chain(rng, 4)
    ids = iter(range(1, 10**6))
    stored = 0

    def store(pub: EventPublisher, tokens: list[int]) -> None:
        nonlocal stored
        pub.publish(
            [BlockStored([next(ids) for _ in range(len(tokens) // BLOCK)], None, tokens, BLOCK)]
        )
        stored += (len(tokens) // BLOCK) * (pub is flood)

    try:
        await sub.add_worker(endpoint("w0", flood))
        await sub.add_worker(endpoint("w1", other))
        await wait_for(sub.ready)
        sub.set_capacity(FLOOD, {"GPU": 80})  # x 1.25: at most 100 entries
        await wait_for(lambda: index.rank_cap(FLOOD) == (100, "capacity"))
        assert index.rank_cap(OTHER) == (0, "")
        store(flood, hot)
        store(flood, cold)
        await caught_up(sub, FLOOD, flood)
        others = []
        for _ in range(12):  # 12 x 40 distinct blocks, the hot chain matched (used) in between
            assert index.match(index.request_hashes(hot)).workers[FLOOD].matched_blocks == 4
            for _ in range(10):
                store(flood, chain(rng, 4))
            others.append(chain(rng, 2))
            store(other, others[-1])
            await caught_up(sub, FLOOD, flood)
            await caught_up(sub, OTHER, other)
            assert held(index, FLOOD) <= 100
        assert index.match(index.request_hashes(hot)).workers[FLOOD].matched_blocks == 4
        assert index.match(index.request_hashes(cold)).workers[FLOOD].matched_blocks == 0
        st = index.worker_stats(FLOOD)
        assert st.rank_evicted_entries == stored - held(index, FLOOD) >= stored - 100
        assert st.evicted_entries == 0 and (st.max_entries, st.cap_source) == (100, "capacity")
        # the other rank lost nothing and was never capped
        assert held(index, OTHER) == 2 * len(others)
        for t in others:
            assert index.match(index.request_hashes(t)).workers[OTHER].matched_blocks == 2
        assert index.worker_stats(OTHER).rank_evicted_entries == 0
        warned = [r for r in caplog.records if r.name == "kvrouter.index"]
        assert len(warned) == 1 and "worker w0 rank 0" in warned[0].getMessage()
        # the capacity forgotten: the rank has no cap again and keeps what it sends
        sub.set_capacity(FLOOD, None)
        await wait_for(lambda: index.rank_cap(FLOOD) == (0, ""))
        for _ in range(40):
            store(flood, chain(rng, 4))
        await caught_up(sub, FLOOD, flood)
        assert held(index, FLOOD) > 100
    finally:
        await sub.aclose()


def _flood(index: PrefixIndex, key: tuple[str, int], n: int, *, page: int = BLOCK, start: int = 0,
           tier: str = "GPU") -> None:  # fmt: skip
    """``n`` distinct chains of 4 router blocks on ``key``, engine pages of ``page`` tokens."""
    rng = random.Random(start)
    for i in range(n):
        tokens = chain(rng, 4)
        hashes = [start + i * 1000 + j + 1 for j in range(4 * BLOCK // page)]
        index.apply_event(key, BlockStored(hashes, None, tokens, page, tier=tier))


def test_default_cap_per_rank_and_tiers_without_a_size() -> None:
    index = PrefixIndex(BLOCK)
    index.set_rank_caps(200, margin=1.25)
    _flood(index, FLOOD, 100)
    assert index.rank_cap(FLOOD) == (200, "default")
    assert index.entries() <= 200 and index.worker_stats(FLOOD).rank_evicted_entries >= 200
    # a known capacity replaces the default: what it leaves over goes at once
    assert index.set_rank_capacity(FLOOD, {"GPU": 40})
    assert index.rank_cap(FLOOD) == (50, "capacity") and index.entries() <= 50
    assert not index.set_rank_capacity(("nobody", 0), {"GPU": 1})
    # blocks on a tier whose size the worker did not report: never under the default
    _flood(index, FLOOD, 30, start=10**6, tier="CPU_PINNED")
    assert index.rank_cap(FLOOD) == (200, "default")
    assert 50 < index.entries() <= 200
    index.set_rank_capacity(FLOOD, {"GPU": 40, "CPU_PINNED": 400})
    assert index.rank_cap(FLOOD) == (550, "capacity")
    with pytest.raises(ValueError):
        index.set_rank_capacity(FLOOD, {"VRAM": 4})
    # a new rank gets the default
    index.add_worker("w2")
    assert index.rank_cap(("w2", 0)) == (200, "default")


def test_rechunked_rank_is_capped_and_frees_its_engine_blocks() -> None:
    """SGLang's page size 1: 16 engine blocks a router block, each its own entry."""
    index = PrefixIndex(BLOCK)
    index.set_rank_caps(0)
    index.add_worker(*FLOOD)
    index.set_rank_capacity(FLOOD, {"GPU": 1000})
    rng = random.Random(1)
    hot = chain(rng, 4)
    index.apply_event(FLOOD, BlockStored(list(range(1, 65)), None, hot, 1))
    for k in range(1, 40):
        assert index.match(index.request_hashes(hot)).workers[FLOOD].matched_blocks == 4
        index.enforce_cap()  # the writer's round: the match becomes a recency mark
        _flood(index, FLOOD, 1, page=1, start=k * 10**4)
        assert index.entries() <= 1000
    assert index.match(index.request_hashes(hot)).workers[FLOOD].matched_blocks == 4
    assert index.worker_stats(FLOOD).rank_evicted_entries >= 39 * 64 + 64 - 1000


def test_rechunked_removals_leaves_first_leave_nothing_behind() -> None:
    """An engine evicting leaves first (SGLang's radix tree) empties a router block's engine
    blocks before its first one goes: none of them stays in the index."""
    index = PrefixIndex(BLOCK)
    tokens = list(range(64))
    index.apply_event(FLOOD, BlockStored(list(range(1, 65)), None, tokens, 1))
    assert (index.entries(), len(index)) == (64, 4)
    index.apply_event(FLOOD, BlockRemoved(list(range(64, 0, -1))))
    assert (index.entries(), len(index)) == (0, 0)


def test_global_cap_squeezes_every_rank_alike_on_a_running_count() -> None:
    """``max_index_entries``: over it every rank gives up alike. The applier keeps the count of
    entries batch by batch (what the cap reads each round), exact through clears and removals."""
    index = PrefixIndex(BLOCK)
    index.set_cap(300)
    state = index._state  # the running count is the index's own; checked against a full count
    for k in range(20):
        _flood(index, FLOOD, 5, start=2 * k * 10**4)
        _flood(index, OTHER, 5, start=(2 * k + 1) * 10**4)
        index.enforce_cap()  # the writer's round
        assert index.entries() <= 300 and state.counted_total == index.entries()
    a, b = (index.worker_stats(k).evicted_entries for k in (FLOOD, OTHER))
    assert a + b == index.evicted_entries >= 20 * 40 - 300 and abs(a - b) <= 40
    assert index.worker_stats(FLOOD).rank_evicted_entries == 0
    index.clear_worker(*FLOOD)
    index.remove_worker(OTHER[0])
    assert state.counted_total == index.entries() == 0
