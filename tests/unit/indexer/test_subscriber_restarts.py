"""A new publisher process behind the same endpoints, seen on reconnect and on snapshot resume
(not only when a live seq goes backwards), and the freshness a join-time replay leaves behind.
Real ZMQ on 127.0.0.1, a real PrefixIndex."""

from __future__ import annotations

from pathlib import Path

import zmq.asyncio

from indexer.events import ResumePoint
from indexer.index import PrefixIndex
from indexer.subscriber import WorkerEndpoint
from tests.unit.indexer.conftest import caught_up, endpoint, started, stream, sync_live
from tests.unit.indexer.kv_publisher import (
    EventPublisher,
    RecordingIndex,
    StreamGen,
    assert_same_index,
    reference,
)
from tests.waiting import wait_for

KEY = ("w0", 0)
KEY_A = ("a", 0)


async def _replace_process(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher], old: EventPublisher, sub: object
) -> EventPublisher:
    await old.aclose()
    await wait_for(lambda: not sub.stats()[KEY].connected, what="disconnect seen")  # type: ignore[attr-defined]
    new = EventPublisher(ctx, events_addr=old.events, replay_addr=old.replay or "")
    pubs.append(new)
    return new


async def test_reconnect_to_a_new_process_further_ahead(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    """The new process already sent more than the old one did: its seqs never go backwards on
    the live stream, yet the old blocks must go and the new process's must come in."""
    index = RecordingIndex()
    sub = await started(index, ctx)
    old = EventPublisher(ctx)
    pubs.append(old)
    try:
        await sub.add_worker(endpoint("w0", old))
        await wait_for(lambda: sub.worker_ready("w0"))
        old_gen = StreamGen(80, remove_ratio=0.0)
        await stream(old, old_gen, 10)
        await caught_up(sub, KEY, old)
        assert index.worker_stats(KEY).blocks_by_tier["GPU"] > 0
        new = await _replace_process(ctx, pubs, old, sub)
        gen = StreamGen(81)
        for _ in range(25):  # sent before the reconnection: only a replay can deliver them
            new.publish(gen.events(), drop=True)
        await wait_for(lambda: sub.stats()[KEY].restarts == 1, what="new process detected")
        await caught_up(sub, KEY, new)
        st = sub.stats()[KEY]
        assert st.trusted and st.replay_failures == 0
        assert new.replay_requests[0] == 9  # asked from the last applied seq, to check it
        assert new.replay_requests[1] == 0  # then the new process's whole stream
        assert index.applied[KEY][-25:] == list(range(25))
        assert_same_index(index, reference({KEY: new.batches}), [KEY], gen.queries())
        res = index.match(index.request_hashes(old_gen.queries()[0]))
        assert res.workers[KEY].matched_blocks == 0  # the old process's blocks are gone
    finally:
        await sub.aclose()


async def test_reconnect_to_an_idle_new_process_drops_the_old_blocks(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = PrefixIndex()
    sub = await started(index, ctx)
    old = EventPublisher(ctx)
    pubs.append(old)
    try:
        await sub.add_worker(endpoint("w0", old))
        await wait_for(lambda: sub.worker_ready("w0"))
        await stream(old, StreamGen(82, remove_ratio=0.0), 12)
        await caught_up(sub, KEY, old)
        new = await _replace_process(ctx, pubs, old, sub)
        await wait_for(lambda: sub.stats()[KEY].restarts == 1, what="new process detected")
        assert index.worker_stats(KEY).blocks_by_tier["GPU"] == 0
        assert new.replay_requests[0] == 11
        gen = StreamGen(83)
        await wait_for(lambda: not sub.stats()[KEY].replaying)
        await stream(new, gen, 30)
        await caught_up(sub, KEY, new)
        assert sub.stats()[KEY].trusted
    finally:
        await sub.aclose()


async def test_snapshot_resume_checks_the_publisher(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher], tmp_path: Path
) -> None:
    """Worker a kept running (continue after the snapshot seq: its buffer no longer reaches seq
    0, so the resume reconciles at the snapshot's seq); worker b restarted and went past the
    snapshot seq (its whole new stream, nothing of the old one: rebuilt from seq 0)."""
    a, b = EventPublisher(ctx, buffer=30), EventPublisher(ctx)
    pubs += [a, b]
    ka, kb = ("a", 0), ("b", 0)
    gen_a, gen_b = StreamGen(84), StreamGen(85, remove_ratio=0.0)
    first = PrefixIndex()
    sub = await started(first, ctx)
    try:
        await sub.add_worker(endpoint("a", a))
        await sub.add_worker(endpoint("b", b))
        await wait_for(sub.ready)
        await stream(a, gen_a, 40)
        await stream(b, gen_b, 20)
        await caught_up(sub, ka, a)
        await caught_up(sub, kb, b)
        points = sub.resume_points()
        assert points == {ka: a.seq - 1, kb: b.seq - 1}
        assert points[kb].ts == b.batches[-1].ts
        first.snapshot(tmp_path / "index.snap", points)
    finally:
        await sub.aclose()
    snap_a = a.seq
    await stream(a, gen_a, 10)
    b.restart()
    gen_b2 = StreamGen(86)
    await stream(b, gen_b2, 22)  # the new process is 2 seqs past the snapshot
    index, restored = RecordingIndex.restore(tmp_path / "index.snap")
    assert isinstance(restored[kb], ResumePoint) and restored[kb].ts == points[kb].ts
    sub = await started(index, ctx)
    try:
        sub.restore_seqs(restored)
        await sub.add_worker(endpoint("a", a))
        await sub.add_worker(endpoint("b", b))
        await caught_up(sub, ka, a)
        await caught_up(sub, kb, b)
        sa, sb = sub.stats()[ka], sub.stats()[kb]
        assert sa.restarts == 0 and sa.replay_failures == 0
        assert index.applied[ka] == list(range(snap_a, a.seq))
        # b's publisher holds its whole (new) stream: the rank is rebuilt from it alone
        assert sb.restarts == 0 and sb.replay_failures == 0 and sb.trusted
        assert sub.snapshot_drops()["rebuilt"] == 1
        assert b.replay_requests[-1] == 0
        # a's replay asked from 0 (to reconcile); its buffer began at 20: checked at seq 39
        assert a.replay_requests[-1] == 0
        assert index.applied[kb] == list(range(b.seq))
        ref = reference({ka: a.batches, kb: b.batches})
        assert_same_index(index, ref, [ka, kb], gen_a.queries() + gen_b2.queries())
        old_b = index.match(index.request_hashes(gen_b.queries()[0]))
        assert old_b.workers[kb].matched_blocks == 0
    finally:
        await sub.aclose()


async def test_join_replay_sets_freshness(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    pub = EventPublisher(ctx)
    pubs.append(pub)
    await stream(pub, StreamGen(87), 5)  # before the router subscribes: replay only
    index = PrefixIndex()
    sub = await started(index, ctx)
    try:
        await sub.add_worker(endpoint("w0", pub))
        await wait_for(lambda: sub.worker_ready("w0"))
        await caught_up(sub, KEY, pub)
        st = sub.stats()[KEY]
        assert st.replayed == 5
        assert st.last_message_at is not None and st.lag_s is not None and st.lag_s >= 0
        assert sub.seconds_since_last_message("w0") is not None
    finally:
        await sub.aclose()


async def test_a_restored_rank_nothing_can_check_is_cleared_and_a_foreign_rank_dropped(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher], tmp_path: Path
) -> None:
    """Issue 37, 7: a snapshot's rank of a worker with no replay endpoint (nothing can prove its
    entries) is cleared and rebuilt from live events; a rank beyond the worker's dp_ranks is
    dropped; both counted. (Before, both were kept for good.)"""
    a = EventPublisher(ctx)
    pubs.append(a)
    gen = StreamGen(90, remove_ratio=0.0)
    first = PrefixIndex()
    sub = await started(first, ctx)
    try:
        await sub.add_worker(endpoint("a", a))
        await wait_for(sub.ready)
        await stream(a, gen, 10)
        await caught_up(sub, KEY_A, a)
        points = sub.resume_points()
    finally:
        await sub.aclose()
    first.add_worker("a", 3)  # a made-up rank: worker a has one
    first.apply_batch("a", a.batches[0], dp_rank=3)
    first.snapshot(tmp_path / "index.snap", {**points, ("a", 3): ResumePoint(0, 1.0)})
    index, restored = PrefixIndex.restore(tmp_path / "index.snap")
    assert index.worker(KEY_A).entries() > 0 and ("a", 3) in restored
    sub = await started(index, ctx)
    try:
        sub.restore_seqs(restored)
        await sub.add_worker(WorkerEndpoint("a", a.events, None))  # no replay endpoint
        assert sorted(index.workers()) == [KEY_A] and index.worker(KEY_A).entries() == 0
        assert sub.snapshot_drops() == {"unconfigured_rank": 1, "unverifiable": 1, "rebuilt": 0}
        await sync_live(a, sub, KEY_A)  # (past the slow-joiner window)
        a.publish(gen.events())  # live events rebuild it
        await wait_for(lambda: index.worker(KEY_A).entries() > 0, what="a live event applied")
    finally:
        await sub.aclose()
