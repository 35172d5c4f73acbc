"""Replica sync under CURVE (issue 37, trust): real ``ReplicaSync``s and real ZMQ strangers over
TCP on loopback. Replicas with the same peer key sync (over ``ipc://`` too); a subscriber without
the key, with a made-up key or another fleet's hears nothing; a publisher without the key cannot
inject; each refused handshake is counted by reason and logged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import zmq
from sync_peers import BS, drain, key_file, msg, raw_pub, raw_sub, sync

from router.placement import Placed
from router.runtime.replicas import PeerKey
from tests.waiting import wait_for

OTHER = PeerKey(b"another fleet's secret, long enough")


async def test_replicas_with_the_peer_key_sync_over_tcp_and_ipc(tmp_path: Path) -> None:
    key = key_file(tmp_path)
    a = sync(sync_bind="tcp://127.0.0.1:0", peer_key_file=key, heartbeat_s=0.05)
    b = sync(sync_bind=f"ipc://{tmp_path}/b.sock", peer_key_file=key, heartbeat_s=0.05)
    await a.start()
    await b.start()
    try:
        assert a.curve is not None and b.curve is not None and a.endpoint and b.endpoint
        a.set_peers([b.endpoint])
        b.set_peers([a.endpoint])
        await wait_for(lambda: a.stats().peers == 1 and b.stats().peers == 1, 10, "heartbeats")
        d = a.placer.place(list(range(1000, 1000 + 4 * BS)))
        a.placer.fly(d, d.order[0], "proxy")
        await wait_for(lambda: len(b.placer.remote) == 1, 10, "b applied a's ticket")
        assert sum(a.stats().handshake_failed.values()) == 0
        assert sum(b.stats().handshake_failed.values()) == 0
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_subscriber_without_the_key_hears_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvrouter.replicas")
    key = key_file(tmp_path)
    a = sync(sync_bind="tcp://127.0.0.1:0", peer_key_file=key, heartbeat_s=0.05)
    b = sync(peer_key_file=key, heartbeat_s=0.05, peers=[])  # a keyed listener, to compare
    await a.start()
    await b.start()
    ctx: zmq.Context = zmq.Context()
    try:
        assert a.curve is not None and a.endpoint
        b.set_peers([a.endpoint])
        made_up = zmq.curve_keypair()  # knows the (public) server key, not the secret
        strangers = {
            "plain": raw_sub(ctx, a.endpoint),
            "made_up": raw_sub(ctx, a.endpoint, curve=(*made_up, a.curve.public)),
            "other_fleet": raw_sub(ctx, a.endpoint, curve=(*OTHER.curve(), OTHER.curve()[0])),
        }
        hf = a.stats

        def refused() -> bool:
            f = hf().handshake_failed
            # (the plain one: a mechanism mismatch, or, when it hangs up first, no detail)
            return f["mechanism"] + f["other"] >= 1 and f["auth"] >= 1 and f["crypto"] >= 1

        await wait_for(refused, 10, "the three strangers refused at the handshake")
        seen = b.received
        await wait_for(lambda: b.received >= seen + 5, 10, "the keyed peer hears a on")
        assert {k: drain(s) for k, s in strangers.items()} == dict.fromkeys(strangers, 0)
        text = caplog.text
        assert "handshake with a subscriber on tcp://127.0.0.1:" in text
        for reason in ("auth", "crypto"):
            assert f"failed ({reason})" in text
    finally:
        ctx.destroy(linger=0)
        await a.aclose()
        await b.aclose()


async def test_a_publisher_without_the_key_cannot_inject(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvrouter.replicas")
    key = key_file(tmp_path)
    a = sync(peer_key_file=key, heartbeat_s=0.05)
    good = sync(sync_bind="tcp://127.0.0.1:0", peer_key_file=key, heartbeat_s=0.05)
    await a.start()
    await good.start()
    ctx: zmq.Context = zmq.Context()
    plain, plain_ep = raw_pub(ctx)
    other, other_ep = raw_pub(ctx, curve=OTHER.curve())
    try:
        assert good.endpoint
        a.set_peers([plain_ep, other_ep, good.endpoint])
        seq = 0

        def injected() -> bool:  # (keep sending: a SUB may join at any time)
            nonlocal seq
            ev = [Placed(seq, "a", 0, [7, 8, 9], 3.0, 0)]
            plain.send(msg(seq, ev, origin="plain")[0])
            other.send(msg(seq, ev, origin="other")[0])
            seq += 1
            assert a.links is not None
            return {plain_ep, other_ep} <= a.links.failing and a.stats().peers

        await wait_for(injected, 10, "both refused and the keyed peer heard")
        assert set(a.origins) == {good.origin}
        st = a.stats()
        assert st.remote_tickets == 0 and a.placer.load.get(("a", 0)) is None
        assert sum(st.handshake_failed.values()) >= 2
        for ep in (plain_ep, other_ep):  # (why: mechanism, crypto, or no detail: libzmq's timing)
            assert f"handshake with a peer on {ep} failed (" in caplog.text
    finally:
        ctx.destroy(linger=0)
        await a.aclose()
        await good.aclose()
