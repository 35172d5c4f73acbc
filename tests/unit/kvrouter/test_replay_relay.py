"""The live replay's faulty path (:mod:`kvrouter.replay.relay`) over real ZMQ sockets: the engine's
own publisher, the relay, and a subscriber in the router's place. Every message arrives with the
engine's seq (no gap) while its events are dropped, its clears swallowed or its stores reseeded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from engine.publisher import EventPublisher
from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from indexer.wire import decode_message
from kvrouter.replay.faults import SALT
from kvrouter.replay.relay import EventRelay
from tests.waiting import poll


def _stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=list(range(i, i + 4)), block_size=4
    )


class Rig:
    """publisher -> relay -> subscriber, connected (the first messages of a PUB/SUB pair are lost
    until the subscription has reached the publisher: probes go until one comes through, then
    every probe sent after it is read back, one message each, before the counts start)."""

    def __init__(self, ctx: zmq.Context, **faults: object) -> None:
        self.pub = EventPublisher("tcp://127.0.0.1:0", context=ctx)
        self.relay = EventRelay(self.pub.endpoint, context=ctx, **faults)  # type: ignore[arg-type]
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.relay.endpoint)
        poll(self._probe, 10, "a message through the relay")
        last = self.pub.next_seq - 1
        while decode_message(self.sub.recv_multipart()).seq != last:  # (probes on the way)
            pass
        self.relay.dropped.clear()
        self.first = self.pub.next_seq

    def _probe(self) -> bool:
        self.pub.publish([BlockRemoved(block_hashes=[0])])
        return bool(self.sub.poll(20))

    def send(self, batches: list[list[Event]]) -> list[EventBatch]:
        for events in batches:
            self.pub.publish(events)
        out = []
        for _ in batches:
            assert self.sub.poll(5000), "a message did not come through"
            out.append(decode_message(self.sub.recv_multipart()))
        return out

    def close(self) -> None:
        self.sub.close(linger=0)
        self.relay.close()
        self.pub.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.term()


def test_lost_events_leave_no_sequence_gap(ctx: zmq.Context) -> None:
    rig = Rig(ctx, drop_p=0.5, seed=1)
    try:
        sent = [[_stored(10 * b + i) for i in range(4)] for b in range(50)]
        got = rig.send(sent)
    finally:
        rig.close()
    # one message per batch, the engine's seqs in order: the router sees no gap
    assert [b.seq for b in got] == list(range(rig.first, rig.first + 50))
    kept = [ev for b in got for ev in b.events]
    assert rig.relay.dropped["BlockStored"] + len(kept) == 200
    assert 60 < len(kept) < 140  # about half lost, and what passes is what was sent
    assert all(ev in [e for batch in sent for e in batch] for ev in kept)
    assert any(b.events == [] for b in got)  # a batch that lost all its events still arrives


def test_every_event_lost(ctx: zmq.Context) -> None:
    rig = Rig(ctx, drop_p=1.0)
    try:
        got = rig.send([[_stored(1)], [BlockRemoved(block_hashes=[1])]])
    finally:
        rig.close()
    assert [b.events for b in got] == [[], []]
    assert rig.relay.dropped == {"BlockStored": 1, "BlockRemoved": 1}


def test_a_silent_restart_swallows_the_clear_and_nothing_else(ctx: zmq.Context) -> None:
    rig = Rig(ctx, silent_clears=True)
    try:
        got = rig.send([[_stored(1)], [AllBlocksCleared(), _stored(2)]])
    finally:
        rig.close()
    assert [b.events for b in got] == [[_stored(1)], [_stored(2)]]
    assert rig.relay.dropped == {"AllBlocksCleared": 1}


def test_another_hash_seed_shifts_the_stored_tokens_only(ctx: zmq.Context) -> None:
    rig = Rig(ctx, reseed=True)
    try:
        (got,) = rig.send([[_stored(1), BlockRemoved(block_hashes=[7])]])
    finally:
        rig.close()
    stored, removed = got.events
    assert isinstance(stored, BlockStored) and stored.token_ids == [t + SALT for t in range(1, 5)]
    assert stored.block_hashes == [1] and removed == BlockRemoved(block_hashes=[7])


def test_without_a_fault_the_bytes_pass_unchanged(ctx: zmq.Context) -> None:
    rig = Rig(ctx)
    try:
        rig.pub.publish([_stored(3)], ts=12.5)
        assert rig.sub.poll(5000)
        topic, seq, payload = rig.sub.recv_multipart()
    finally:
        rig.close()
    assert (topic, int.from_bytes(seq, "big")) == (b"kv-events", rig.first)
    got = decode_message([topic, seq, payload])
    assert got.ts == 12.5 and got.events == [_stored(3)]


def test_a_probability_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="drop_p"):
        EventRelay("tcp://127.0.0.1:1", drop_p=1.5)
