"""Issue 37, item 10: sync origins are not bound to a connection, so a peer (a hostile key holder
or a buggy one) can send under another's origin. Real ``ReplicaSync``s and a real ZMQ spoofer:
a huge seq under a real peer's origin no longer silences it, and a flood of made-up origins no
longer locks a new replica out of the full peer table."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
from sync_peers import BS, Clock, msg, raw_pub, sync

from router.runtime.replicas.origins import MAX_PEERS, SEQ_WINDOW, Origins, Seq
from tests.waiting import wait_for


def test_a_seq_far_off_is_a_reset_and_a_near_one_in_order() -> None:
    o = Origins(max_peers=2)
    assert o.admit("p", 10, 1.0) == (Seq.NEW, None)
    assert o.admit("p", 11, 1.0)[0] is Seq.NEXT
    assert o.admit("p", 11, 1.0)[0] is Seq.STALE  # a copy
    assert o.admit("p", 14, 1.0)[0] is Seq.GAP and o.gaps == 2
    assert o.admit("p", 16 + SEQ_WINDOW, 1.0)[0] is Seq.RESET  # far ahead: not a gap of 65k
    assert o.admit("p", 15 + SEQ_WINDOW, 1.0)[0] is Seq.STALE  # (a copy, a little behind)
    assert o.admit("p", 15, 1.0)[0] is Seq.RESET  # far behind it: the real stream, heard
    assert o.admit("p", 16, 1.0)[0] is Seq.NEXT and (o.gaps, o.resets) == (2, 2)
    assert o.admit("p", 17, 1.0, "10.0.0.1")[0] is Seq.NEXT  # (bound to its first known address)
    assert o.admit("p", 18, 1.0, "10.0.0.2")[0] is Seq.SPOOFED
    assert o.admit("p", 18, 1.0, "10.0.0.1")[0] is Seq.NEXT
    assert o.admit("q", 0, 2.0) == (Seq.NEW, None)
    assert o.admit("p", 19, 3.0)[0] is Seq.NEXT  # p heard last now: q is the longest silent
    assert o.admit("r", 0, 4.0) == (Seq.NEW, "q") and o.evicted == 1 and list(o) == ["p", "r"]
    assert o.silent(3.5) == ["p"] and list(o) == ["r"]


@pytest.mark.parametrize("where", ["same_address", "other_address"])
async def test_a_spoofed_origin_with_a_huge_seq_does_not_silence_the_real_one(
    tmp_path: Path, where: str
) -> None:
    """The spoofer (TCP on 127.0.0.1) sends under b's origin. From another address than b's
    (b on ``ipc://``) it is dropped as ``spoofed``; from the same (b on TCP on 127.0.0.1 too) it
    is applied as a reset, and b's next message is a reset back: b is heard either way. On the
    old code every message of b's after the spoof was ``stale``, for good."""
    bind = "tcp://127.0.0.1:0" if where == "same_address" else f"ipc://{tmp_path}/b.sock"
    a = sync(heartbeat_s=0.05)
    b = sync(sync_bind=bind, heartbeat_s=0.05)
    ctx: zmq.Context = zmq.Context()
    spoofer, spoof_ep = raw_pub(ctx)
    await a.start()
    await b.start()
    try:
        assert b.endpoint
        a.set_peers([b.endpoint, spoof_ep])
        await wait_for(lambda: b.origin in set(a.origins), 10, "a hears b")

        def spoofed() -> bool:  # (a SUB joins late: send until it lands)
            spoofer.send(msg(1 << 62, [], origin=b.origin)[0])
            return a.origins.resets + a.dropped["spoofed"] >= 1

        await wait_for(spoofed, 10, "the spoof judged")
        d = b.placer.place(list(range(2000, 2000 + 4 * BS)))
        b.placer.fly(d, d.order[0], "proxy")  # b's next message
        await wait_for(lambda: len(a.placer.remote) == 1, 10, "a applied b's ticket")
        st = a.stats()
        assert st.gaps < 1000 and st.peers == 1  # (not 2^62 "lost" messages)
        if where == "same_address":
            assert st.resets >= 2 and st.dropped["spoofed"] == 0
        else:
            assert st.resets == 0 and st.dropped["spoofed"] >= 1
    finally:
        ctx.destroy(linger=0)
        await a.aclose()
        await b.aclose()


async def test_a_flood_of_made_up_origins_does_not_lock_a_new_replica_out(
    tmp_path: Path,
) -> None:
    a = sync(heartbeat_s=0.05, peer_timeout_s=60.0)
    ctx: zmq.Context = zmq.Context()
    flood, flood_ep = raw_pub(ctx)
    c = sync(sync_bind=f"ipc://{tmp_path}/c.sock", heartbeat_s=0.05)
    await a.start()
    try:
        a.set_peers([flood_ep])

        def joined() -> bool:
            flood.send(msg(0, [], origin="fake-0")[0])
            return len(a.origins) == 1

        await wait_for(joined, 10, "the flood connected")
        fakes = MAX_PEERS + 100
        for i in range(1, fakes):  # in batches within the SUB's queue (replicas.max_queue_mib)
            flood.send(msg(0, [], origin=f"fake-{i}")[0])
            if i % 32 == 0 or i == fakes - 1:
                heard = lambda n=i + 1: len(a.origins) + a.origins.evicted == n  # noqa: E731
                await wait_for(heard, 10, "a batch")
        assert a.origins.evicted == fakes - MAX_PEERS
        assert len(a.origins) == MAX_PEERS and "fake-0" not in set(a.origins)
        await c.start()
        assert c.endpoint
        a.set_peers([flood_ep, c.endpoint])
        await wait_for(lambda: c.origin in set(a.origins), 10, "a new replica heard")
        st = a.stats()
        assert st.peers == MAX_PEERS and st.peers_evicted == fakes - MAX_PEERS + 1
    finally:
        ctx.destroy(linger=0)
        await a.aclose()
        await c.aclose()


def test_a_peer_evicted_from_the_table_takes_its_tickets_with_it() -> None:
    from router.placement import Placed

    s = sync(Clock())
    s.on_message(msg(0, [Placed(1, "a", 0, [1, 2], 2.0, 0)], origin="first"))
    for i in range(MAX_PEERS):
        s.on_message(msg(0, [], origin=f"o{i}"))
    assert "first" not in set(s.origins) and len(s.placer.remote) == 0
    assert s.placer.remote.ended["peer_lost"] == 1 and s.stats().peers_evicted == 1
