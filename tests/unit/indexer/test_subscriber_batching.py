"""Batched reads (``Subscriber(batch_window=...)``, ``indexer/subscriber/sockets.py``): a busy
stream is read once per window, over real ZMQ sockets on 127.0.0.1, and nothing is lost, reordered
or left unread when the readers come off the loop, when a worker joins or leaves meanwhile, or
when the stream falls quiet."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from tests.unit.indexer.conftest import caught_up, endpoint, started, sync_live
from tests.unit.indexer.kv_publisher import EventPublisher, RecordingIndex, StreamGen
from tests.waiting import wait_for


async def paced(pub: EventPublisher, gen: StreamGen, n: int, seen: list[bool], sub) -> None:
    """``n`` messages, one per loop pass plus a millisecond (the publisher's pace, not a wait
    for state), noting whether the subscriber was batching after each."""
    for _ in range(n):
        pub.publish(gen.events())
        await asyncio.sleep(0.001)
        seen.append(sub.batching)


async def test_a_busy_stream_is_read_in_windows_and_nothing_is_lost(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx, batch_window=0.05)
    a, b = EventPublisher(ctx), EventPublisher(ctx)
    pubs += [a, b]
    ka, kb = ("a", 0), ("b", 0)
    try:
        await sub.add_worker(endpoint("a", a))
        await sync_live(a, sub, ka)
        seen: list[bool] = []
        gen_a, gen_b = StreamGen(1), StreamGen(2)
        await paced(a, gen_a, 60, seen, sub)
        assert any(seen), "a message every millisecond never switched to batched reads"
        # a worker joining while the readers are off the loop (as they are here unless the test
        # stalled for a window) is read at the next poll
        await sub.add_worker(endpoint("b", b))
        await sync_live(b, sub, kb)
        await asyncio.gather(paced(a, gen_a, 60, seen, sub), paced(b, gen_b, 60, seen, sub))
        await caught_up(sub, ka, a)
        await caught_up(sub, kb, b)
        assert index.applied[ka] == list(range(a.seq))  # every seq once, in order
        assert index.applied[kb] == list(range(b.seq))
        assert sub.stats()[ka].gaps == 0 and sub.stats()[kb].gaps == 0
        # quiet for a window: the readers go back on the loop, and a lone message still arrives
        await wait_for(lambda: not sub.batching, what="readers back on the loop")
        await sub.remove_worker("b")
        a.publish(gen_a.events())
        await caught_up(sub, ka, a)
        assert index.applied[ka] == list(range(a.seq))
        assert not sub.batching  # one message after a quiet spell is read on its own wake-up
    finally:
        await sub.aclose()
    assert not sub.batching  # no poll timer outlives the subscriber


async def test_without_a_window_every_message_is_read_as_it_comes(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)  # batch_window=0, the library's default
    a = EventPublisher(ctx)
    pubs.append(a)
    try:
        await sub.add_worker(endpoint("a", a))
        await sync_live(a, sub, ("a", 0))
        seen: list[bool] = []
        await paced(a, StreamGen(1), 60, seen, sub)
        await caught_up(sub, ("a", 0), a)
        assert not any(seen)
        assert index.applied[("a", 0)] == list(range(a.seq))
    finally:
        await sub.aclose()
