"""What an engine can really reuse, sent over real ZMQ to a real Subscriber and PrefixIndex:
duplicate stores, engine pages larger than a router block, extra keys (cache salt, multimodal,
LoRA), partial-prefix KV cache groups of hybrid models, and hostile ``medium`` names."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import zmq.asyncio

from indexer.events import BlockRemoved, BlockStored, Event
from indexer.index import MAX_UNKNOWN_MEDIUMS, PrefixIndex
from indexer.subscriber import Subscriber
from tests.unit.indexer.conftest import caught_up, endpoint, started
from tests.unit.indexer.kv_publisher import BLOCK, EventPublisher
from tests.waiting import wait_for

KEY = ("w0", 0)


class Rig:
    def __init__(self, pub: EventPublisher, sub: Subscriber, index: PrefixIndex) -> None:
        self.pub, self.sub, self.index = pub, sub, index

    async def send(self, *events: Event) -> None:
        self.pub.publish(list(events))
        await caught_up(self.sub, KEY, self.pub)

    def matched(self, tokens: Sequence[int], **kw: Any) -> int:
        res = self.index.match(self.index.request_hashes(tokens, **kw))
        return res.workers[KEY].matched_blocks


@pytest.fixture
async def rig(ctx: zmq.asyncio.Context, pubs: list[EventPublisher]) -> AsyncIterator[Rig]:
    pub = EventPublisher(ctx)
    pubs.append(pub)
    index = PrefixIndex(BLOCK)
    sub = await started(index, ctx)
    await sub.add_worker(endpoint("w0", pub))
    await wait_for(lambda: sub.worker_ready("w0"))
    yield Rig(pub, sub, index)
    await sub.aclose()


def toks(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def stored(hashes: list[int], parent: int | None, tokens: list[int], size: int = BLOCK, **kw: Any):
    return BlockStored(hashes, parent, tokens, size, **kw)


async def test_a_duplicate_store_needs_two_removals(rig: Rig) -> None:
    t = toks(3 * BLOCK)
    await rig.send(stored([1, 2, 3], None, t))
    await rig.send(stored([3], 2, t[2 * BLOCK :]))  # the last page recomputed into a 2nd block
    assert rig.index.worker_stats(KEY).duplicate_stores == 1
    await rig.send(BlockRemoved([3]))
    assert rig.matched(t) == 3  # one physical copy is still there
    await rig.send(BlockRemoved([3]))
    assert rig.matched(t) == 2
    await rig.send(BlockRemoved([3]))  # one removal too many: counted, nothing else
    assert rig.index.worker_stats(KEY).unknown_removals == 1


async def test_duplicates_count_per_tier(rig: Rig) -> None:
    t = toks(BLOCK, 2)
    await rig.send(stored([7], None, t, medium="CPU"), stored([7], None, t, medium="CPU"))
    await rig.send(stored([7], None, t))
    await rig.send(BlockRemoved([7], medium="CPU"))
    m = rig.index.match(rig.index.request_hashes(t)).workers[KEY]
    assert m.matched_blocks == 1
    await rig.send(BlockRemoved([7]))  # GPU was stored once: it leaves, CPU still holds one
    assert rig.index.match(rig.index.request_hashes(t)).workers[KEY].by_tier == {
        "GPU": 0,
        "CPU_PINNED": 1,
    }


@pytest.mark.parametrize("page", [32, 128])
async def test_credit_rounds_down_to_whole_engine_pages(rig: Rig, page: int) -> None:
    t = toks(3 * page, 3)
    await rig.send(stored([11, 12, 13], None, t, size=page))
    per_page = page // BLOCK
    assert rig.matched(t) == 3 * per_page
    # a request ending one router block into the third page: the engine reuses two pages
    assert rig.matched(t[: 2 * page + BLOCK]) == 2 * per_page
    assert rig.matched(t[: page - BLOCK]) == 0
    await rig.send(BlockRemoved([13]))
    assert rig.matched(t) == 2 * per_page


async def test_cache_salt_separates_namespaces(rig: Rig) -> None:
    t = toks(4 * BLOCK, 4)
    u = toks(2 * BLOCK, 5)
    salted = stored([21, 22, 23], None, t[: 3 * BLOCK], extra_keys=[["tenant-a"], None, None])
    await rig.send(salted, stored([24], 23, t[3 * BLOCK :]))  # a later store inherits the salt
    await rig.send(stored([31, 32], None, u))
    assert rig.matched(t) == 0  # an unsalted request never meets salted blocks
    assert rig.matched(t, cache_salt="tenant-a") == 4
    assert rig.matched(t, cache_salt="tenant-b") == 0
    assert rig.matched(u) == 2 and rig.matched(u, cache_salt="tenant-a") == 0


async def test_lora_key_is_the_namespace_and_multimodal_keys_split_the_chain(rig: Rig) -> None:
    t = toks(3 * BLOCK, 6)
    lora = stored([41, 42], None, t[: 2 * BLOCK], lora_name="ad", extra_keys=[["ad", "s"], ["ad"]])
    await rig.send(lora)
    assert rig.matched(t, lora_name="ad", cache_salt="s") == 2
    assert rig.matched(t, lora_name="ad") == 0 and rig.matched(t, cache_salt="s") == 0
    image = stored([51, 52, 53], None, t, extra_keys=[None, [["img-hash", 0]], None])
    await rig.send(image)
    assert rig.matched(t) == 1  # a text request cannot carry the image: first block only


async def test_salted_pages_and_rechunked_stores(rig: Rig) -> None:
    t = toks(4 * BLOCK, 7)
    await rig.send(stored([61, 62], None, t, size=2 * BLOCK, extra_keys=[["s"], None]))
    assert rig.matched(t, cache_salt="s") == 4 and rig.matched(t) == 0


async def test_partial_prefix_groups_do_not_count(rig: Rig) -> None:
    t = toks(2 * BLOCK, 8)
    await rig.send(stored([71, 72], None, t, group_idx=1, kv_cache_spec_kind="sliding_window"))
    assert rig.matched(t) == 0
    await rig.send(stored([71, 72], None, t))  # the full-attention group
    await rig.send(BlockRemoved([71, 72], group_idx=1))  # the window moved on: not our group
    assert rig.matched(t) == 2
    assert rig.index.worker_stats(KEY).partial_group_events == 2
    await rig.send(BlockRemoved([72]))
    assert rig.matched(t) == 1


async def test_hostile_medium_names_are_bounded_and_freed(rig: Rig) -> None:
    t = toks(BLOCK, 9)
    for i in range(0, 3000, 100):
        evs: list[Event] = [stored([1000 + j], None, t, medium=f"m{j}") for j in range(i, i + 100)]
        rig.pub.publish(evs)
    await caught_up(rig.sub, KEY, rig.pub)
    index = rig.index
    assert len(index.tier_names) <= 16 and len(index._state.tier_ids) <= 16 + 16
    assert len(index.unknown_tiers) <= 16
    names = index.worker_stats(KEY).unknown_mediums
    assert len(names) == MAX_UNKNOWN_MEDIUMS + 1 and names["OTHER"] == 3000 - MAX_UNKNOWN_MEDIUMS
    assert rig.matched(t) == 1
    await rig.sub.remove_worker("w0")
    assert index.workers() == [] and len(index) == 0
