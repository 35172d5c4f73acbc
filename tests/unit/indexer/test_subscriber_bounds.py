"""Memory bounds against a hostile publisher over real ZMQ: a message over ``max_message_bytes``
is refused by libzmq (the connection is dropped, never buffered) and the stream goes on."""

from __future__ import annotations

import zmq.asyncio

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from indexer.wire import encode_message, encode_payload
from tests.unit.indexer.conftest import caught_up, endpoint, started, sync_live
from tests.unit.indexer.kv_publisher import BLOCK, EventPublisher, wait_for

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
