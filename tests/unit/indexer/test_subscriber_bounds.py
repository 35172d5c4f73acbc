"""Memory bounds against a hostile publisher over real ZMQ: a message over ``max_message_bytes``
is refused by libzmq (the connection is dropped, never buffered) and the stream goes on."""

from __future__ import annotations

import random

import zmq.asyncio

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from indexer.wire import encode_message, encode_payload
from tests.unit.indexer.conftest import caught_up, endpoint, started, sync_live
from tests.unit.indexer.kv_publisher import BLOCK, EventPublisher
from tests.waiting import wait_for

KEY = ("w0", 0)


async def test_oversized_message_is_refused_and_the_stream_recovers(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    pub = EventPublisher(ctx)
    pubs.append(pub)
    index = PrefixIndex(BLOCK)
    sub = await started(index, ctx, max_message_bytes=1 << 20)
    try:
        await sub.add_worker(endpoint("w0", pub))
        await wait_for(lambda: sub.worker_ready("w0"))
        await sync_live(pub, sub, KEY)
        before = sub.stats()[KEY].messages
        tokens = list(range(BLOCK))
        huge = encode_payload(
            [BlockStored([1], None, tokens * (1 << 18), BLOCK)], ts=1.0, dp_rank=0
        )
        assert len(huge) > 4 << 20
        pub.send_raw(encode_message(pub.topic, pub.seq + 1000, huge))
        # libzmq drops the connection; the subscriber dials again and resumes with a replay
        await wait_for(lambda: len(pub.replay_requests) == 2, what="reconnected and resumed")
        assert pub.replay_requests == [0, 0]
        pub.publish([BlockStored([2], None, tokens, BLOCK)])
        await caught_up(sub, KEY, pub)
        st = sub.stats()[KEY]
        assert st.messages == before + 1 and st.malformed == 0 and st.gaps == 0
        res = index.match(index.request_hashes(tokens))
        assert res.workers[KEY].matched_blocks == 1
    finally:
        await sub.aclose()


async def test_index_cap_evicts_least_recently_matched_first(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    """A publisher floods the index past ``max_entries``: the chain requests keep matching
    stays, an old chain nobody asks for goes, and the entries stay under the cap."""
    pub = EventPublisher(ctx)
    pubs.append(pub)
    index = PrefixIndex(BLOCK)
    index.set_cap(200)
    sub = await started(index, ctx)
    rng = random.Random(5)

    def chain(n: int) -> list[int]:
        return [rng.randrange(1, 50_000) for _ in range(n * BLOCK)]

    hot, cold = chain(4), chain(4)
    next_hash = iter(range(1, 10**6))
    try:
        await sub.add_worker(endpoint("w0", pub))
        await wait_for(lambda: sub.worker_ready("w0"))
        for t in (hot, cold):
            pub.publish([BlockStored([next(next_hash) for _ in range(4)], None, t, BLOCK)])
        await caught_up(sub, KEY, pub)
        for _ in range(12):  # 12 x 40 blocks of flood, the hot chain asked for in between
            assert index.match(index.request_hashes(hot)).workers[KEY].matched_blocks == 4
            for _ in range(10):
                pub.publish(
                    [BlockStored([next(next_hash) for _ in range(4)], None, chain(4), BLOCK)]
                )
            await caught_up(sub, KEY, pub)
            assert index.entries() <= 200
        assert index.match(index.request_hashes(hot)).workers[KEY].matched_blocks == 4
        assert index.match(index.request_hashes(cold)).workers[KEY].matched_blocks == 0
        st = index.worker_stats(KEY)
        assert st.evicted_entries == index.evicted_entries >= 8 + 12 * 40 - 200
        assert sum(st.blocks_by_tier.values()) == index.entries()
    finally:
        await sub.aclose()
