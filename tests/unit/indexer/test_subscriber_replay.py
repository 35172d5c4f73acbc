"""The subscriber's replay (``indexer/subscriber/replay.py``) over real ZMQ sockets on 127.0.0.1:
gaps filled from a worker's replay endpoint, a missing or dead one, the join-time replay from
zero, and the replay after a snapshot. Publishers (PUB + ROUTER replay) run as asyncio tasks in
the test; the subscriber applies to a real PrefixIndex that also records applied seqs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from indexer.index import PrefixIndex
from indexer.subscriber import Subscriber
from indexer.wire import encode_message
from tests.unit.indexer.conftest import caught_up, endpoint, started, stream, sync_live
from tests.unit.indexer.kv_publisher import (
    EventPublisher,
    RecordingIndex,
    StreamGen,
    assert_same_index,
    reference,
)
from tests.waiting import wait_for


@pytest.mark.parametrize("topic_in_replies", [True, False], ids=["topic-layout", "old-layout"])
async def test_two_percent_dropped_is_replayed_to_lossless_state(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher], topic_in_replies: bool
) -> None:
    index = RecordingIndex()
    # every replay must succeed here: a loaded CI machine once took over the default 2 s to
    # answer one (timeouts have their own tests)
    sub = await started(index, ctx, replay_timeout=20.0)
    pub = EventPublisher(ctx, topic_in_replies=topic_in_replies)
    pubs.append(pub)
    key = ("w0", 0)
    try:
        await sub.add_worker(endpoint("w0", pub))
        await wait_for(lambda: sub.worker_ready("w0"))
        await sync_live(pub, sub, key)
        gen = StreamGen(2)
        await stream(pub, gen, 1500, drop=0.02)
        pub.publish(gen.events())  # a last one sent live reveals a trailing gap
        await caught_up(sub, key, pub)
        st = sub.stats()[key]
        assert index.applied[key] == list(range(pub.seq))  # in order, each exactly once
        assert st.gaps >= 10 and st.replays >= st.gaps and st.replayed >= st.gaps
        assert st.replay_failures == 0 and st.trusted and st.malformed == 0
        ref = reference({key: pub.batches})
        assert st.orphans == ref.worker_stats(key).orphans
        assert_same_index(index, ref, [key], gen.queries())
    finally:
        await sub.aclose()


async def test_no_replay_endpoint_drops_flags_and_recovers(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)
    pub = EventPublisher(ctx, replay=False)
    pubs.append(pub)
    key = ("w0", 0)
    try:
        await sub.add_worker(endpoint("w0", pub))
        await wait_for(lambda: sub.worker_ready("w0"))
        await sync_live(pub, sub, key)
        gen = StreamGen(3, remove_ratio=0.0)
        await stream(pub, gen, 100)
        await caught_up(sub, key, pub)
        assert sub.stats()[key].trusted
        pub.publish(gen.events(), drop=True)  # lost for good
        revealing = pub.publish(gen.events())
        await wait_for(lambda: sub.stats()[key].replay_failures == 1)
        st = sub.stats()[key]
        assert not st.trusted and st.gaps == 1 and st.last_seq == revealing
        assert sum(st.blocks_by_tier.values()) <= 4  # everything before the gap is gone
        await stream(pub, gen, 50)
        await caught_up(sub, key, pub)
        st = sub.stats()[key]
        assert st.trusted and st.replay_failures == 1 and st.gaps == 1
        ref = reference({key: pub.batches[revealing:]})
        assert_same_index(index, ref, [key], gen.queries())
    finally:
        await sub.aclose()


async def test_dead_replay_endpoint_times_out_without_stalling_others(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx, replay_timeout=3.0)
    a, b = EventPublisher(ctx), EventPublisher(ctx)
    pubs += [a, b]
    ka, kb = ("a", 0), ("b", 0)
    try:
        await sub.add_worker(endpoint("a", a))
        await sub.add_worker(endpoint("b", b))
        await wait_for(sub.ready)
        await sync_live(a, sub, ka)
        await sync_live(b, sub, kb)
        gen_a, gen_b = StreamGen(4), StreamGen(5)
        await stream(a, gen_a, 20)
        await caught_up(sub, ka, a)
        a.replay_mode = "silent"
        a.publish(gen_a.events(), drop=True)
        revealing = a.publish(gen_a.events())
        t0 = time.monotonic()
        await wait_for(lambda: sub.stats()[ka].replaying)
        await stream(b, gen_b, 100)
        # b's stream is applied while a's replay is still waiting for its dead endpoint
        await wait_for(lambda: sub.stats()[kb].last_seq == b.seq - 1, 2.5)
        assert sub.stats()[ka].replaying
        await wait_for(lambda: sub.stats()[ka].replay_failures == 1)
        assert time.monotonic() - t0 >= 2.5
        st = sub.stats()[ka]
        assert not st.trusted and not st.replaying and st.last_seq == revealing
        a.publish(gen_a.events())
        await wait_for(lambda: sub.stats()[ka].trusted)
        ref = reference({ka: a.batches[revealing:], kb: b.batches})
        assert_same_index(index, ref, [ka, kb], gen_a.queries() + gen_b.queries())
    finally:
        await sub.aclose()


async def joining(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher], seed: int, sent: int, delay: float
) -> tuple[RecordingIndex, Subscriber, EventPublisher, StreamGen]:
    """A subscriber joining worker ``w0``, whose publisher sent ``sent`` batches to nobody and
    answers the join replay ``delay`` seconds after it is asked, which it has been on return."""
    index = RecordingIndex()
    sub = await started(index, ctx)
    try:
        pub = EventPublisher(ctx)
        pubs.append(pub)
        gen = StreamGen(seed)
        await stream(pub, gen, sent)  # nobody is listening yet
        pub.reply_delay = delay
        await sub.add_worker(endpoint("w0", pub))
        await wait_for(lambda: bool(pub.replay_requests), what="join replay request")
    except BaseException:
        await sub.aclose()
        raise
    return index, sub, pub, gen


async def test_join_replays_from_zero_without_applying_twice(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    # live batches arrive while the join replay is under way
    index, sub, pub, gen = await joining(ctx, pubs, 30, 300, 0.5)
    key = ("w0", 0)
    try:
        while not sub.worker_ready("w0"):
            pub.publish(gen.events())
            await asyncio.sleep(0.005)
        await stream(pub, gen, 100)
        await caught_up(sub, key, pub)
        st = sub.stats()[key]
        assert index.applied[key] == list(range(pub.seq))  # each exactly once, in order
        assert st.replayed >= 300 and st.replay_done and st.replay_failures == 0
        assert st.skipped > 0  # buffered live batches the replay had covered were not re-applied
        assert pub.replay_requests[0] == 0
        assert_same_index(index, reference({key: pub.batches}), [key], gen.queries())
    finally:
        await sub.aclose()


async def test_live_copies_read_after_the_join_replay_are_not_applied_again(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    # The join replay brings seqs whose live copies are still queued on the SUB (not drained
    # yet, or held for a read window): read after the replay ended, above the last live seq,
    # they are the same batches, not a new publisher process.
    index, sub, pub, gen = await joining(ctx, pubs, 31, 50, 0.3)
    key = ("w0", 0)
    try:
        late = [pub.publish(gen.events(), drop=True) for _ in range(5)]  # replayed, not sent
        await wait_for(lambda: sub.worker_ready("w0"), what="join replay done")
        assert sub.stats()[key].last_seq == late[-1]
        for seq, payload in list(pub.buffer)[-5:]:  # now their live copies come
            pub.send_raw(encode_message(pub.topic, seq, payload))
        await stream(pub, gen, 20)
        await caught_up(sub, key, pub)
        st = sub.stats()[key]
        assert index.applied[key] == list(range(pub.seq))  # each exactly once, in order
        assert st.restarts == 0 and st.skipped == 5
        assert_same_index(index, reference({key: pub.batches}), [key], gen.queries())
    finally:
        await sub.aclose()


async def test_a_restored_rank_without_a_batch_ts_is_cleared_and_joins_like_a_new_one(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher], tmp_path: Path
) -> None:
    a, b = EventPublisher(ctx), EventPublisher(ctx, buffer=20)
    pubs += [a, b]
    ka, kb = ("a", 0), ("b", 0)
    gen_a, gen_b = StreamGen(50), StreamGen(51, remove_ratio=0.0)
    first = PrefixIndex()
    sub = await started(first, ctx)
    try:
        await sub.add_worker(endpoint("a", a))
        await sub.add_worker(endpoint("b", b))
        await wait_for(sub.ready)
        await stream(a, gen_a, 100)
        await stream(b, gen_b, 15)
        await caught_up(sub, ka, a)
        await caught_up(sub, kb, b)
        seqs = {k: st.last_seq for k, st in sub.stats().items()}
        assert seqs == {ka: a.seq - 1, kb: b.seq - 1}
        first.snapshot(tmp_path / "index.snap", seqs)  # type: ignore[arg-type]
    finally:
        await sub.aclose()
    snap_a, snap_b = a.seq, b.seq
    await stream(a, gen_a, 50)  # published while the router was down
    await stream(b, gen_b, 40)  # more than b still buffers: its gap cannot be replayed
    index, restored = RecordingIndex.restore(tmp_path / "index.snap")
    assert isinstance(index, RecordingIndex) and restored == seqs
    sub = await started(index, ctx)
    try:
        sub.restore_seqs(restored)
        await sub.add_worker(endpoint("a", a))
        await sub.add_worker(endpoint("b", b))
        await caught_up(sub, ka, a)
        await caught_up(sub, kb, b)
        # seqs without a batch ts cannot tell the publisher's process: the snapshot's entries
        # are cleared and each rank joins like a new one (a from its whole stream, b from
        # what it still buffers)
        assert index.applied[ka] == list(range(a.seq))
        assert index.applied[kb] == list(range(b.seq - 20, b.seq))
        assert a.replay_requests[-1] == 0 and b.replay_requests[-1] == 0
        assert (snap_a, snap_b) == (100, 15)
        sa, sb = sub.stats()[ka], sub.stats()[kb]
        assert sa.replay_failures == 0 and sa.trusted
        assert sb.replay_failures == 0 and sb.trusted
        assert sub.snapshot_drops()["unverifiable"] == 2
        ref = reference({ka: a.batches, kb: b.batches[b.seq - 20 :]})
        assert_same_index(index, ref, [ka, kb], gen_a.queries() + gen_b.queries())
        b.publish(gen_b.events())
        await wait_for(lambda: sub.stats()[kb].trusted)
    finally:
        await sub.aclose()
