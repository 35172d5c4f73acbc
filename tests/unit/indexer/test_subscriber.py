"""Subscriber over real ZMQ sockets on 127.0.0.1: publishers (PUB + ROUTER replay) run as asyncio
tasks in the test, the subscriber applies to a real PrefixIndex that also records applied seqs."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from indexer.events import AllBlocksCleared, BlockStored, EventBatch
from indexer.index import PrefixIndex
from indexer.subscriber import SubscriberError, WorkerEndpoint, rank_endpoint
from indexer.wire import encode_message, encode_payload
from indexer.wire.frames import pack_seq
from tests.unit.indexer.conftest import caught_up, endpoint, started, stream, sync_live
from tests.unit.indexer.kv_publisher import (
    EventPublisher,
    RecordingIndex,
    StreamGen,
    assert_same_index,
    dp_publishers,
    reference,
)
from tests.waiting import wait_for


def count_events(batches: list[EventBatch], kind: type) -> int:
    return sum(isinstance(ev, kind) for b in batches for ev in b.events)


async def test_ordered_stream(ctx: zmq.asyncio.Context, pubs: list[EventPublisher]) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)
    pub = EventPublisher(ctx)
    pubs.append(pub)
    key = ("w0", 0)
    try:
        await sub.add_worker(endpoint("w0", pub))
        await wait_for(lambda: sub.worker_ready("w0") and sub.ready(), what="ready")
        await sync_live(pub, sub, key)
        gaps = sub.stats()[key].gaps
        gen = StreamGen(1)
        t0 = time.time()
        await stream(pub, gen, 400)
        await caught_up(sub, key, pub)
        st = sub.stats()[key]
        assert index.applied[key] == list(range(pub.seq))
        assert st.messages == pub.seq and st.gaps == gaps and st.replay_failures == 0
        assert st.trusted and st.malformed == 0 and st.restarts == 0 and st.apply_errors == 0
        assert st.events_by_type["BlockStored"] == count_events(pub.batches, BlockStored)
        assert st.events_by_type["BlockRemoved"] == pub.seq - st.events_by_type["BlockStored"] - (
            sum(not b.events for b in pub.batches)
        )
        assert st.lag_s is not None and 0 <= st.lag_s < 10
        assert st.last_message_at is not None and st.last_message_at >= t0
        freshness = sub.seconds_since_last_message("w0")
        assert freshness is not None and 0 <= freshness < 10
        assert sub.seconds_since_last_message("nobody") is None
        ref = reference({key: pub.batches})
        assert st.blocks_by_tier == ref.worker_stats(key).blocks_by_tier
        assert st.blocks_by_tier["GPU"] > 0 and st.orphans == ref.worker_stats(key).orphans
        assert_same_index(index, ref, [key], gen.queries())
    finally:
        await sub.aclose()


async def test_publisher_restart_drops_entries(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)
    pub = EventPublisher(ctx)
    pubs.append(pub)
    key = ("w0", 0)
    try:
        await sub.add_worker(endpoint("w0", pub))
        await wait_for(lambda: sub.worker_ready("w0"))
        await sync_live(pub, sub, key)
        await stream(pub, StreamGen(6), 60)
        await caught_up(sub, key, pub)
        before = list(index.applied[key])
        pub.restart()
        gen = StreamGen(7)
        pub.publish(gen.events(), drop=True)  # seq 0 and 1 of the new process: replay only
        pub.publish(gen.events(), drop=True)
        await stream(pub, gen, 40)
        await caught_up(sub, key, pub)
        st = sub.stats()[key]
        assert st.restarts == 1 and st.replay_failures == 0 and st.trusted
        assert index.applied[key] == before + list(range(pub.seq))
        assert index.worker_stats(key).cleared == 1
        assert_same_index(index, reference({key: pub.batches}), [key], gen.queries())
    finally:
        await sub.aclose()


def garbage(i: int) -> list[bytes]:
    t = b"kv-events"
    cases = [
        [b"one frame"],
        [t, pack_seq(1)],
        [t, b"\x00" * 7, b"\x93"],
        [t, pack_seq(i), b"\xc1"],  # reserved msgpack byte
        [t, pack_seq(i), b"\x93\xcb\x41"],  # truncated
        [t, pack_seq(i), msgspec.msgpack.encode({"not": "a batch"})],
        [t, pack_seq(i), msgspec.msgpack.encode([1.0, [["BlockStored", "x", None]], 0])],
        [t, pack_seq(i), b"\xdd\xff\xff\xff\xff\x01"],  # array of 2**32-1 elements
        [t, pack_seq(i), b"\x93\xcb" + b"\x00" * 8 + b"\x91\x91" * 1500],
        [t, pack_seq(i), b"x", b"four frames"],
    ]
    return cases[i % len(cases)]


async def test_garbage_worker_does_not_affect_others(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)
    bad = EventPublisher(ctx, replay=False)
    good = [EventPublisher(ctx) for _ in range(3)]
    pubs += [bad, *good]
    names = ["g0", "g1", "g2"]
    try:
        await sub.add_worker(endpoint("bad", bad))
        for name, p in zip(names, good):
            await sub.add_worker(endpoint(name, p))
        await wait_for(sub.ready)
        for name, p in zip(names, good):
            await sync_live(p, sub, (name, 0))
        await sync_live(bad, sub, ("bad", 0))
        gens = [StreamGen(10 + i) for i in range(3)]
        for i in range(300):
            for p, g in zip(good, gens):
                p.publish(g.events())
            bad.send_raw(garbage(i))
            if i % 32 == 31:
                await asyncio.sleep(0)
        for name, p in zip(names, good):
            await caught_up(sub, (name, 0), p)
        await wait_for(lambda: sub.stats()[("bad", 0)].malformed == 300)
        keys = [(n, 0) for n in names]
        for key, p in zip(keys, good):
            st = sub.stats()[key]
            assert st.malformed == 0 and st.gaps == 0 and st.trusted
            assert index.applied[key] == list(range(p.seq))
        ref = reference({k: p.batches for k, p in zip(keys, good)})
        assert_same_index(index, ref, keys, [q for g in gens for q in g.queries()])
        # the garbage worker is still served: a valid batch after the garbage is applied
        seq = bad.publish([BlockStored([1], None, list(range(16)), 16)])
        await wait_for(lambda: sub.stats()[("bad", 0)].last_seq == seq)
        assert index.worker_stats(("bad", 0)).blocks_by_tier["GPU"] == 1
    finally:
        await sub.aclose()


async def test_remove_worker_mid_stream(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)
    a, b = EventPublisher(ctx), EventPublisher(ctx)
    pubs += [a, b]
    ka, kb = ("a", 0), ("b", 0)
    try:
        await sub.add_worker(endpoint("a", a))
        await sub.add_worker(endpoint("b", b))
        await wait_for(sub.ready)
        gen_a, gen_b = StreamGen(20), StreamGen(21)
        await stream(a, gen_a, 100)
        await stream(b, gen_b, 100)
        await caught_up(sub, ka, a)
        await sub.remove_worker("a")
        applied_a = list(index.applied[ka])
        assert ka not in index.workers() and ka not in sub.stats()
        assert not sub.worker_ready("a") and "a" not in sub.workers()
        await stream(a, gen_a, 50)
        await stream(b, gen_b, 50)
        await caught_up(sub, kb, b)
        assert index.applied[ka] == applied_a
        ref = reference({kb: b.batches})
        assert_same_index(index, ref, [kb], gen_b.queries())
        assert all(ka not in index.match(index.request_hashes(q)).workers for q in gen_a.queries())
        await sub.remove_worker("a")  # idempotent
        # added again: the join replay rebuilds it from what the publisher still buffers
        await sub.add_worker(endpoint("a", a))
        await caught_up(sub, ka, a)
        assert index.applied[ka][len(applied_a) :] == list(range(a.seq))
        ref = reference({ka: a.batches, kb: b.batches})
        assert_same_index(index, ref, [ka, kb], gen_a.queries() + gen_b.queries())
    finally:
        await sub.aclose()


async def test_two_dp_ranks_on_two_ports(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)
    ranks = dp_publishers(ctx, 2)
    pubs += ranks
    keys = [("w", 0), ("w", 1)]
    try:
        await sub.add_worker(endpoint("w", ranks[0], dp_ranks=2))
        await wait_for(lambda: sub.worker_ready("w"))
        assert set(sub.stats()) == set(keys)
        gens = [StreamGen(40), StreamGen(41)]
        for p, g in zip(ranks, gens):
            await stream(p, g, 200, drop=0.02)
            p.publish(g.events())
        for k, p in zip(keys, ranks):
            await caught_up(sub, k, p)
            assert index.applied[k] == list(range(p.seq))
            assert sub.stats()[k].replay_failures == 0
        ref = reference({k: p.batches for k, p in zip(keys, ranks)})
        assert_same_index(index, ref, keys, gens[0].queries() + gens[1].queries())
        await sub.remove_worker("w")
        assert not [k for k in index.workers() if k[0] == "w"]
    finally:
        await sub.aclose()


async def test_publisher_process_restart_on_same_ports(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)
    old = EventPublisher(ctx)
    pubs.append(old)
    key = ("w0", 0)
    try:
        await sub.add_worker(endpoint("w0", old))
        await wait_for(lambda: sub.worker_ready("w0"))
        await stream(old, StreamGen(70), 80)
        await caught_up(sub, key, old)
        await old.aclose()
        await wait_for(lambda: not sub.stats()[key].connected, what="disconnect seen")
        new = EventPublisher(ctx, events_addr=old.events, replay_addr=old.replay or "")
        pubs.append(new)
        await wait_for(lambda: sub.stats()[key].connected, what="reconnected")
        gen = StreamGen(71)
        while sub.stats()[key].restarts == 0:  # what the new process sends before the
            new.publish(gen.events())  # reconnection is lost live and replayed
            await asyncio.sleep(0.01)
        await stream(new, gen, 40)
        await caught_up(sub, key, new)
        st = sub.stats()[key]
        assert st.restarts == 1 and st.replay_failures == 0 and st.trusted
        # the reconnect asked from the last applied seq, to check who answers it
        assert new.replay_requests[0] == old.seq - 1
        assert index.applied[key][-new.seq :] == list(range(new.seq))
        assert_same_index(index, reference({key: new.batches}), [key], gen.queries())
    finally:
        await sub.aclose()


async def test_hostile_sequence_numbers(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    sub = await started(index, ctx)
    bad, ok = EventPublisher(ctx), EventPublisher(ctx)
    pubs += [bad, ok]
    kb, ko = ("bad", 0), ("ok", 0)
    try:
        await sub.add_worker(endpoint("bad", bad))
        await sub.add_worker(endpoint("ok", ok))
        await wait_for(sub.ready)
        await sync_live(bad, sub, kb)
        gen = StreamGen(80)
        await stream(ok, gen, 20)
        store = [BlockStored([7], None, list(range(16)), 16)]
        top = 2**64 - 1
        bad.send_raw(encode_message(b"", top, encode_payload(store, ts=time.time())))
        await wait_for(lambda: sub.stats()[kb].last_seq == top)
        assert sub.stats()[kb].replay_failures == 1  # the replay could not reach 2**64 - 2
        bad.send_raw(encode_message(b"", top, encode_payload([], ts=time.time())))
        await wait_for(lambda: sub.stats()[kb].restarts == 1)
        await stream(ok, gen, 20)
        await caught_up(sub, ko, ok)
        assert index.applied[ko] == list(range(ok.seq))
        assert_same_index(index, reference({ko: ok.batches}), [ko], gen.queries())
    finally:
        await sub.aclose()


class FlakyIndex(RecordingIndex):
    """A real index whose apply raises on some batches of one worker (a bug to survive)."""

    def apply_batch(self, worker_id: str, batch: EventBatch, *, dp_rank: int | None = None) -> None:
        super().apply_batch(worker_id, batch, dp_rank=dp_rank)
        if worker_id == "flaky" and batch.seq % 5 == 0:
            raise RuntimeError("index bug")


async def test_index_errors_are_counted_not_fatal(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = FlakyIndex()
    sub = await started(index, ctx)
    flaky, ok = EventPublisher(ctx), EventPublisher(ctx)
    pubs += [flaky, ok]
    try:
        await sub.add_worker(endpoint("flaky", flaky))
        await sub.add_worker(endpoint("ok", ok))
        await wait_for(sub.ready)
        gen = StreamGen(60)
        for i in range(50):
            flaky.publish([AllBlocksCleared()] if i % 7 == 0 else [])
            ok.publish(gen.events())
        await caught_up(sub, ("flaky", 0), flaky)
        await caught_up(sub, ("ok", 0), ok)
        assert sub.stats()[("flaky", 0)].apply_errors == 10
        assert sub.stats()[("flaky", 0)].events_by_type["AllBlocksCleared"] == 8
        assert sub.stats()[("ok", 0)].apply_errors == 0
        assert index.applied[("flaky", 0)] == list(range(50))
        assert_same_index(index, reference({("ok", 0): ok.batches}), [("ok", 0)], gen.queries())
    finally:
        await sub.aclose()


async def test_on_applied_hears_each_rank_after_its_batches_and_may_fail(
    ctx: zmq.asyncio.Context, pubs: list[EventPublisher]
) -> None:
    index = RecordingIndex()
    heard: dict[tuple[str, int], int] = {}  # rank -> last seq applied when it was told

    def on_applied(key: tuple[str, int]) -> None:
        heard[key] = index.applied[key][-1]
        if key[0] == "bad":
            raise RuntimeError("a listener's bug")

    sub = await started(index, ctx, on_applied=on_applied)  # type: ignore[arg-type]
    good, bad = EventPublisher(ctx), EventPublisher(ctx)
    pubs += [good, bad]
    try:
        await sub.add_worker(endpoint("good", good))
        await sub.add_worker(endpoint("bad", bad))
        await wait_for(sub.ready)
        gen = StreamGen(7)
        for _ in range(30):
            good.publish(gen.events())
            bad.publish(gen.events())
        await caught_up(sub, ("good", 0), good)
        await caught_up(sub, ("bad", 0), bad)
        # told after the last batch was in the index; the listener's failure lost nothing
        assert heard == {("good", 0): good.seq - 1, ("bad", 0): bad.seq - 1}
        assert index.applied[("bad", 0)] == list(range(bad.seq))
        assert sub.stats()[("bad", 0)].apply_errors == 0
    finally:
        await sub.aclose()


async def test_registration_errors(ctx: zmq.asyncio.Context, pubs: list[EventPublisher]) -> None:
    sub = await started(PrefixIndex(), ctx)
    pub = EventPublisher(ctx)
    pubs.append(pub)
    try:
        for bad in (
            WorkerEndpoint("x", "not-an-endpoint"),
            WorkerEndpoint("x", "tcp://127.0.0.1:port"),
            WorkerEndpoint("x", "tcp://127.0.0.1:65535", dp_ranks=2),
            WorkerEndpoint("x", pub.events, dp_ranks=0),
            WorkerEndpoint("", pub.events),
            WorkerEndpoint("x", "bogus://127.0.0.1:1"),
        ):
            with pytest.raises(SubscriberError):
                await sub.add_worker(bad)
            assert "x" not in sub.workers()
        await sub.add_worker(endpoint("x", pub))
        await sub.add_worker(endpoint("x", pub))  # the same again: no-op
        with pytest.raises(SubscriberError):
            await sub.add_worker(WorkerEndpoint("x", pub.events))
        assert sub.workers() == {"x": endpoint("x", pub)}
    finally:
        await sub.aclose()
    with pytest.raises(SubscriberError):
        await sub.add_worker(endpoint("y", pub))


def test_rank_endpoints() -> None:
    assert rank_endpoint("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert rank_endpoint("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert rank_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert rank_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
