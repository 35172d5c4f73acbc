"""Replica sync between two real router processes (``python -m router serve``), each subscribed to
the same real fake workers' KV events, synced over ZMQ ``ipc://`` endpoints: one places, the
other follows the prefix it is computing and steers away from the load it placed; a lost sync
message ends by TTL; a dead peer never holds the other's placement up."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from replica_procs import ADMIN, RouterProc, candidate, metric, ready, route, until

from router.placement import Ended
from router.runtime.replicas.wire import VERSION, SyncMessage, decode, encode

BS = 16


def toks(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(blocks * BS)]


def sync_config(
    workers: list[Any], bind: str, peers: list[str], lanes: bool = False, **replicas: Any
) -> dict:
    """Lanes off unless asked for: the tests of sync itself compare both replicas' first choices,
    which lanes make differ on purpose (test_replicas_in_lanes_take_different_idle_workers)."""
    return {
        "workers": [w.spec() for w in workers],
        "scoring": {} if lanes else {"replica_spread": 0},
        "replicas": {
            "sync_bind": bind,
            "peers": peers,
            "heartbeat_s": 0.1,
            "peer_timeout_s": 2.0,
            **replicas,
        },
    }


async def pair(
    tmp: Path, workers: list[Any], lanes: bool = False, **replicas: Any
) -> tuple[RouterProc, RouterProc]:
    a_ep, b_ep = f"ipc://{tmp}/a.sock", f"ipc://{tmp}/b.sock"
    a, b = await asyncio.gather(
        RouterProc.start(tmp, "a", sync_config(workers, a_ep, [b_ep], lanes, **replicas)),
        RouterProc.start(tmp, "b", sync_config(workers, b_ep, [a_ep], lanes, **replicas)),
    )
    return a, b


async def synced(http: Any, *routers: RouterProc) -> None:
    for r in routers:
        await until(lambda r=r: ready(http, r.url), 30, f"{r.url} ready")
        await until(
            lambda r=r: metric(http, r.url, "kvrouter_replica_peers"), 30, f"{r.url} hears a peer"
        )


async def test_a_replica_follows_the_prefix_its_peer_placed_and_steers_from_its_load(
    workers, http, tmp_path
):
    ws = [await workers(n) for n in ("a", "b", "c")]
    one, two = await pair(tmp_path, ws)
    try:
        await synced(http, one, two)
        # 1. a new 24-block prefix placed (and accounted) by one: two sends a follow-up there,
        # predicted on that worker, which only one's sync message can have told it
        prompt = toks(1, 24)
        first = await route(http, one.url, prompt, account=True)
        w = first["worker_id"]

        async def predicted() -> dict | None:
            ans = await route(http, two.url, prompt + toks(2, 3))
            return ans if candidate(ans, w)["predicted_blocks"] == 24 else None

        follow = await until(predicted, 20, "two sees one's prediction")
        assert follow["worker_id"] == w
        assert candidate(follow, w)["inflight_prefill_blocks"] >= 24  # and its prefill
        resp = await http.post(f"{one.url}/route/{first['route_id']}/release")
        assert resp.status_code == 200

        # 2. a burst through one on a prefix cached on worker a (two requests: both go to a, and
        # a third would not): two, which placed none of it, steers as one does
        shared = toks(3, 4)
        ws[0].store(shared)
        q = shared + toks(4, 30)

        async def indexed() -> bool:
            ans = await route(http, two.url, q)
            return ans["worker_id"] == "a" and ans["matched_blocks"] == 4

        await until(indexed, 20, "two indexed a's prefix and routes q there")
        ids = []
        for i in range(2):
            ans = await route(http, one.url, shared + toks(10 + i, 30), account=True)
            assert ans["worker_id"] == "a"
            ids.append(ans["route_id"])

        async def steered() -> dict | None:
            ans = await route(http, two.url, q)
            return ans if ans["worker_id"] != "a" else None

        away = await until(steered, 20, "two steers q away from a's load")
        ours = await route(http, one.url, q)
        assert away["worker_id"] == ours["worker_id"]  # as the replica that placed the burst
        load_a = candidate(away, "a")
        assert load_a["matched_blocks"] == 4 and load_a["active_blocks"] > 0
        for rid in ids:
            assert (await http.post(f"{one.url}/route/{rid}/release")).status_code == 200
        await until(indexed, 20, "the burst's end reached two: q goes to a again")
        assert await metric(http, two.url, "kvrouter_replica_sync_gaps_total") == 0
        ended = await metric(
            http, two.url, "kvrouter_replica_remote_tickets_ended_total", reason="ended"
        )
        assert ended == 3
    finally:
        await asyncio.gather(one.stop(), two.stop())


async def test_replicas_in_lanes_take_different_idle_workers(workers, http, tmp_path):
    """The default lanes: two replicas that hear each other take lanes 0 and 1, and the same new
    request at both in the same instant goes to two different idle workers, not one."""
    ws = [await workers(n) for n in ("a", "b", "c")]
    one, two = await pair(tmp_path, ws, lanes=True)
    try:
        await synced(http, one, two)
        lanes = [await metric(http, r.url, "kvrouter_replica_lane") for r in (one, two)]
        assert sorted(lanes) == [0, 1]
        prompt = toks(40, 20)
        picks = await asyncio.gather(route(http, one.url, prompt), route(http, two.url, prompt))
        assert picks[0]["worker_id"] != picks[1]["worker_id"]
    finally:
        await asyncio.gather(one.stop(), two.stop())


async def test_a_lost_end_message_expires_by_ttl(workers, http, tmp_path):
    """Replica two hears one through a forwarder here that drops one message: the one that
    ends a ticket. Two counts the gap, and the ticket ends by its TTL."""
    ws = [await workers(n) for n in ("a", "b")]
    ctx = zmq.asyncio.Context()
    fwd_in, fwd_out = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
    fwd_in.setsockopt(zmq.SUBSCRIBE, b"")
    fwd_out.bind(f"ipc://{tmp_path}/fwd.sock")
    one_ep = f"ipc://{tmp_path}/one.sock"
    fwd_in.connect(one_ep)
    dropped: list[int] = []
    drop_ends = False

    async def forward() -> None:
        while True:
            frames = await fwd_in.recv_multipart()
            m = decode(frames[0])
            if drop_ends and any(isinstance(e, Ended) for e in m.events):
                dropped.append(m.seq)
                continue
            await fwd_out.send_multipart(frames)

    task = asyncio.create_task(forward())
    extra = {"ticket_ttl_s": 3.0, "peer_timeout_s": 30.0}
    one = await RouterProc.start(tmp_path, "one", sync_config(ws, one_ep, [], **extra))
    two_cfg = sync_config(ws, f"ipc://{tmp_path}/two.sock", [f"ipc://{tmp_path}/fwd.sock"], **extra)
    two = await RouterProc.start(tmp_path, "two", two_cfg)
    try:
        await synced(http, two)
        await until(lambda: ready(http, one.url), 30, "one ready")
        prompt = toks(5, 8)
        ans = await route(http, one.url, prompt, account=True)
        w = ans["worker_id"]

        async def load_on_two() -> float:
            return candidate(await route(http, two.url, prompt), w)["inflight_prefill_blocks"]

        await until(load_on_two, 20, "two counts one's ticket")
        drop_ends = True
        t0 = time.monotonic()
        assert (await http.post(f"{one.url}/route/{ans['route_id']}/release")).status_code == 200

        async def gone() -> bool:
            return bool(dropped)

        await until(gone, 20, "the end message dropped")
        assert await load_on_two() > 0  # the end never arrived: still counted
        gaps = lambda: metric(http, two.url, "kvrouter_replica_sync_gaps_total")  # noqa: E731
        await until(gaps, 20, "two counts the gap (the next heartbeat shows it)")
        assert await gaps() == 1

        async def expired() -> bool:
            return await load_on_two() == 0

        await until(expired, 20, "two's remote ticket expired")
        assert time.monotonic() - t0 >= 2.5  # by the TTL (3 s after it started), not before
        n = await metric(
            http, two.url, "kvrouter_replica_remote_tickets_ended_total", reason="expired"
        )
        assert n == 1
    finally:
        task.cancel()
        await asyncio.gather(one.stop(), two.stop())
        ctx.destroy(linger=0)


async def test_a_dead_peer_never_blocks_placement_and_its_tickets_end(workers, http, tmp_path):
    ws = [await workers(n) for n in ("a", "b")]
    one, two = await pair(tmp_path, ws)
    try:
        await synced(http, one, two)
        prompt = toks(6, 10)
        ans = await route(http, one.url, prompt, account=True)
        w = ans["worker_id"]

        async def counted() -> float:
            return candidate(await route(http, two.url, prompt), w)["inflight_prefill_blocks"]

        await until(counted, 20, "two counts one's ticket")
        assert await one.stop(signal.SIGKILL) == -signal.SIGKILL  # gone, without a word
        worst = 0.0
        for i in range(50):  # placing never waits for the dead peer
            t = time.monotonic()
            await route(http, two.url, toks(100 + i, 8))
            worst = max(worst, time.monotonic() - t)
        assert worst < 0.5, worst
        # silent past peer_timeout_s (2 s): its tickets stop counting here
        await until(
            lambda: metric(
                http, two.url, "kvrouter_replica_remote_tickets_ended_total", reason="peer_lost"
            ),
            20,
            "two ended the dead peer's ticket",
        )
        assert await counted() == 0
        assert await metric(http, two.url, "kvrouter_replica_peers") == 0
        resp = await http.get(two.url + "/workers", headers=ADMIN)
        assert resp.status_code == 200
    finally:
        await asyncio.gather(one.stop(), two.stop())


async def test_a_frame_that_is_not_utf8_is_dropped_and_sync_goes_on(workers, http, tmp_path):
    """Issue 37, 1: a peer's 4-byte frame (a msgpack str that is not UTF-8) ended the sync task;
    it is one malformed message, counted and dropped, and the replica keeps hearing peers."""
    ws = [await workers("a")]
    ctx = zmq.asyncio.Context()
    evil, good = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
    evil_ep, good_ep = f"ipc://{tmp_path}/evil.sock", f"ipc://{tmp_path}/good.sock"
    evil.bind(evil_ep)
    good.bind(good_ep)
    one = await RouterProc.start(
        tmp_path, "one", sync_config(ws, f"ipc://{tmp_path}/one.sock", [evil_ep, good_ep])
    )
    try:
        await until(lambda: ready(http, one.url), 30, "one ready")

        async def dropped() -> float:  # (a SUB joins late: send until one is counted)
            await evil.send(bytes.fromhex("9501a1ff"))
            return await metric(
                http, one.url, "kvrouter_replica_sync_dropped_total", reason="malformed"
            )

        await until(dropped, 20, "the frame counted as malformed")
        seq = 0

        async def heard() -> float:  # the task still runs: a real peer's heartbeat is applied
            nonlocal seq
            await good.send(encode(SyncMessage(VERSION, "good-peer", seq, BS, [])))
            seq += 1
            return await metric(http, one.url, "kvrouter_replica_peers")

        assert await until(heard, 20, "the good peer heard") == 1
    finally:
        await one.stop()
        ctx.destroy(linger=0)


async def test_a_peer_cut_off_by_an_oversized_frame_is_dialled_again(workers, http, tmp_path):
    """Issue 37, 6: one frame over replicas.max_message_bytes made libzmq drop the peer's
    connection for good (a protocol error: it never redials), uncounted. The replica counts it
    (``cut_off``) and dials the peer again, so its next messages are heard."""
    ws = [await workers("a")]
    ctx = zmq.asyncio.Context()
    peer = ctx.socket(zmq.PUB)
    peer_ep = f"ipc://{tmp_path}/peer.sock"
    peer.bind(peer_ep)
    cfg = sync_config(ws, f"ipc://{tmp_path}/one.sock", [peer_ep], max_message_bytes=300_000)
    one = await RouterProc.start(tmp_path, "one", cfg)
    seq = 0

    async def heard() -> float:
        nonlocal seq
        await peer.send(encode(SyncMessage(VERSION, "the-peer", seq, BS, [])))
        seq += 1
        return await metric(http, one.url, "kvrouter_replica_peers")

    try:
        await until(lambda: ready(http, one.url), 30, "one ready")
        assert await until(heard, 20, "the peer heard") == 1
        await peer.send(b"\x00" * 400_000)  # over max_message_bytes: libzmq cuts the peer off

        async def cut() -> float:
            return await metric(
                http, one.url, "kvrouter_replica_sync_dropped_total", reason="cut_off"
            )

        assert await until(cut, 20, "the cut-off counted") == 1
        before = await metric(http, one.url, "kvrouter_replica_sync_received_total")

        async def again() -> bool:
            await peer.send(encode(SyncMessage(VERSION, "the-peer", seq + 100, BS, [])))
            return await metric(http, one.url, "kvrouter_replica_sync_received_total") > before

        await until(again, 20, "the peer heard again after the redial")
    finally:
        await one.stop()
        ctx.destroy(linger=0)
