"""Replica sync's glue (``router.runtime.replicas.sync``): what a received message must be to
be applied (shape, bounds, block size, sequence), and two real ``ReplicaSync``s over real ZMQ
``ipc://`` sockets in one loop, each around its own placer."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from sync_peers import BS, Clock, msg, sync

from router.placement import Ended, Placed
from router.runtime.replicas import SyncBindError
from router.runtime.replicas.wire import MAX_EVENTS, VERSION
from tests.waiting import wait_for


def test_gaps_are_counted_and_old_or_repeated_messages_dropped() -> None:
    s = sync(Clock())
    s.on_message(msg(7, [Placed(1, "a", 0, [1, 2, 3], 3.0, 0)]))  # the first heard: no gap
    s.on_message(msg(8, []))  # a heartbeat
    s.on_message(msg(12, [Ended(1)]))  # 9, 10, 11 lost
    s.on_message(msg(12, [Placed(2, "a", 0, [4], 1.0, 0)]))  # repeated
    s.on_message(msg(5, [Placed(3, "a", 0, [5], 1.0, 0)]))  # older
    assert (s.received, s.gaps, s.dropped["stale"]) == (3, 3, 2)
    assert len(s.placer.remote) == 0 and s.placer.remote.ended["ended"] == 1
    st = s.stats()
    assert (st.peers, st.gaps, st.received) == (1, 3, 3) and st.dropped["stale"] == 2


def test_only_a_gap_puts_a_peer_s_tickets_on_their_ttl() -> None:
    """A ticket of a peer whose messages all arrived lives past its TTL (its end is still to
    come); a gap exposes the ones placed before it, not the ones after."""
    clock = Clock()
    s = sync(clock, ticket_ttl_s=10.0)
    s.on_message(msg(1, [Placed(1, "a", 0, [1, 2, 3], 3.0, 0)]))
    for seq in range(2, 6):  # heartbeats, 4 TTLs
        clock.t += 10.5
        s.on_message(msg(seq, []))
        s.placer.housekeeping()
    assert len(s.placer.remote) == 1 and s.gaps == 0
    s.on_message(msg(7, [Placed(2, "b", 0, [4], 1.0, 0)]))  # 6 lost: 1's end, maybe
    clock.t += 10.5
    s.placer.housekeeping()
    assert s.gaps == 1 and s.placer.remote.ended["expired"] == 1 and len(s.placer.remote) == 1
    s.on_message(msg(8, [Ended(2)]))
    assert len(s.placer.remote) == 0 and s.placer.remote.ended["ended"] == 1


def test_malformed_or_foreign_messages_are_dropped_and_counted() -> None:
    s = sync(Clock())
    hostile = [
        [b"\xff\x00garbage"],
        [b"one", b"two"],  # two frames
        [msgspec.msgpack.encode([VERSION, "p", 0, BS, [[9, 1]]])],  # an unknown event tag
        [msgspec.msgpack.encode([VERSION, "p", -1, BS, []])],  # a negative seq
        [msgspec.msgpack.encode([VERSION, "", 0, BS, []])],  # no origin
        [msgspec.msgpack.encode([VERSION, "p" * 65, 0, BS, []])],  # an origin too long
        [msgspec.msgpack.encode([VERSION, "p", 0, BS, [[1, 1, "a", 0, [1], -5.0, 0]]])],
        [msgspec.msgpack.encode([VERSION, "p", 0, BS, [[3, 1]] * (MAX_EVENTS + 1)])],
        [msgspec.msgpack.encode([VERSION, "p", 0, BS, [[1, 1, "a", 0, ["x"], 1.0, 0]]])],
    ]
    for frames in hostile:
        s.on_message(frames)
    assert s.dropped["malformed"] == len(hostile) and s.received == 0
    s.on_message(msg(0, [], block_size=32))
    s.on_message([msgspec.msgpack.encode([VERSION + 1, "p", 0, BS, []])])
    s.on_message(msg(0, [Placed(1, "a", 0, [1], 1.0, 0)], origin=s.origin))  # our own: ignored
    assert s.dropped["block_size"] == 1 and s.dropped["version"] == 1
    assert s.received == 0 and len(s.placer.remote) == 0 and s.stats().peers == 0


def test_a_silent_peer_s_tickets_end() -> None:
    clock = Clock()
    s = sync(clock, peer_timeout_s=5.0)
    s.on_message(msg(0, [Placed(1, "a", 0, [1, 2], 2.0, 0), Placed(2, "b", 0, [3], 1.0, 0)]))
    s.on_message(msg(0, [Placed(1, "b", 0, [4], 1.0, 0)], origin="other"))
    assert len(s.placer.remote) == 3
    clock.t += 4.0
    s.on_message(msg(1, [], origin="other"))  # other's heartbeat
    clock.t += 1.5
    s.check_peers(clock.t)  # "peer" silent 5.5 s: gone; "other" heard 1.5 s ago
    assert len(s.placer.remote) == 1 and s.placer.remote.ended["peer_lost"] == 2
    assert s.stats().peers == 1


async def test_two_replicas_sync_over_real_sockets(tmp_path: Path) -> None:
    ep_a, ep_b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    a = sync(time.monotonic, sync_bind=ep_a, peers=[ep_b], heartbeat_s=0.05, peer_timeout_s=5.0)
    b = sync(time.monotonic, sync_bind=ep_b, peers=[ep_a], heartbeat_s=0.05, peer_timeout_s=5.0)
    await a.start()
    await b.start()
    try:
        await wait_for(lambda: a.stats().peers == 1 and b.stats().peers == 1, 10, "heartbeats")
        tokens = list(range(1000, 1000 + 6 * BS))
        d = a.placer.place(tokens)
        f = a.placer.fly(d, d.order[0], "proxy")
        key = f.ticket.key
        await wait_for(lambda: len(b.placer.remote) == 1, 10, "b applied a's ticket")
        lb = b.placer.load.get(key)
        assert lb is not None and lb.requests == 1 and lb.inflight_prefill == 6
        c = b.placer.place(tokens).candidates
        assert next(x for x in c if x.key == key).predicted_blocks == 6
        f.first_byte()
        await wait_for(lambda: lb.inflight_prefill == 0, 10, "b saw the first token")
        f.done("200")
        await wait_for(lambda: b.placer.load.get(key) is None, 10, "b saw the end")
        assert b.gaps == 0 and a.sent >= 3 and b.received >= 3
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_sync_bind_in_use_fails_the_start(tmp_path: Path) -> None:
    a = sync(Clock(), sync_bind="tcp://127.0.0.1:0")
    await a.start()
    try:
        assert a.endpoint is not None and not a.endpoint.endswith(":0")
        b = sync(Clock(), sync_bind=a.endpoint)
        with pytest.raises(SyncBindError):
            await b.start()
        await b.aclose()
    finally:
        await a.aclose()


def test_lanes_follow_the_replicas_heard() -> None:
    clock = Clock()
    s = sync(clock, peer_timeout_s=5.0)
    assert s.placer.lane == (0, 1) and s.stats().lane == 0
    below, above = "0" * 16, "z" * 16  # origins sort around this one's (16 hex digits)
    s.on_message(msg(0, [], origin=above))
    assert s.placer.lane == (0, 2)
    s.on_message(msg(0, [], origin=below))
    assert s.placer.lane == (1, 3) and s.stats().lane == 1
    clock.t += 4.0
    s.on_message(msg(1, [], origin=above))
    clock.t += 1.5
    s.check_peers(clock.t)  # "below" silent 5.5 s: gone
    assert s.placer.lane == (0, 2)
