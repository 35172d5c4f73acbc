"""Warm start from a peer, with real router processes: the workers' replay buffers keep only
their last batch (as vLLM's bounded buffer would after a while), so a cold replica never learns
a prefix stored before, while one started with ``replicas.warm_from`` routes it to the right
worker on its first request; a peer that is down, refuses the key or has another block size
leaves a cold start; the snapshot endpoint is closed without the admin key."""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from typing import Any

import msgspec
from replica_procs import ADMIN, RouterProc, ready, route, until
from snapshot_peer import SnapshotServer

from router.runtime.replicas import SNAPSHOT_PATH, SNAPSHOT_TYPE

BS = 16


def toks(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(blocks * BS)]


def config(workers: list[Any], **replicas: Any) -> dict:
    return {
        "workers": [w.spec() for w in workers],
        "replicas": {"trusted_network": True, **replicas},
    }


async def test_a_warm_replica_routes_the_fleet_s_cache_from_its_first_request(
    workers, http, tmp_path
):
    a, b = await workers("a"), await workers("b")
    prefix = toks(1, 12)
    b.store(prefix)  # b's seq 0: gone from its replay buffer below
    b.store(toks(2, 3))  # b's seq 1, the last: still replayable
    a.store(toks(3, 2))
    peer = await RouterProc.start(tmp_path, "peer", config([a, b]))
    made = [peer]
    try:
        await until(lambda: ready(http, peer.url), 30, "peer ready")

        async def indexed() -> bool:
            return (await route(http, peer.url, prefix))["matched_blocks"] == 12

        await until(indexed, 20, "the peer indexed b's prefix")
        # the snapshot endpoint: admin-keyed
        assert (await http.get(peer.url + SNAPSHOT_PATH)).status_code == 401
        bad = {"authorization": "Bearer nope"}
        assert (await http.get(peer.url + SNAPSHOT_PATH, headers=bad)).status_code == 401
        snap = await http.get(peer.url + SNAPSHOT_PATH, headers=ADMIN)
        assert snap.status_code == 200 and snap.headers["content-type"] == SNAPSHOT_TYPE
        assert snap.headers["x-kvrouter-block-size"] == "16" and len(snap.content) > 100
        for w in (a, b):  # the workers' replay buffers keep their last batch only
            w.buffer = deque(list(w.buffer)[-1:], maxlen=10_000)

        t0 = time.monotonic()
        starts = await asyncio.gather(
            RouterProc.start(tmp_path, "warm", config([a, b], warm_from=[peer.url])),
            RouterProc.start(tmp_path, "cold", config([a, b])),
            RouterProc.start(  # the first peer is down: the second answers
                tmp_path,
                "second",
                config([a, b], warm_from=["http://127.0.0.1:9", peer.url]),
            ),
        )
        made += starts
        warm, cold, second = starts
        for r in starts:
            await until(lambda r=r: ready(http, r.url), 30, f"{r.url} ready")
        for r in (warm, second):  # its very first request
            first = await route(http, r.url, prefix + toks(4, 2))
            assert (first["worker_id"], first["matched_blocks"]) == ("b", 12), r.log()[-2000:]
            assert "warm start: index of" in r.log()
        # the cold one replayed b's last batch only: the prefix is unknown to it
        assert (await route(http, cold.url, prefix))["matched_blocks"] == 0
        # (logged once every stream is live, which /ready does not wait for)
        await until(_logged(warm, "(warm from " + peer.url), 10, "the warm replica's ready line")
        # and the warm one stays live: b's new events reach it, resumed after the snapshot's seq
        more = toks(5, 4)
        b.store(more)

        async def live() -> bool:
            return (await route(http, warm.url, more))["matched_blocks"] == 4

        await until(live, 20, "b's new event indexed by the warm replica")
        assert time.monotonic() - t0 < 60
    finally:
        await asyncio.gather(*(r.stop() for r in made))


async def test_no_usable_peer_means_a_cold_start(workers, http, tmp_path):
    a = await workers("a")
    a.store(toks(6, 4))
    peer = await RouterProc.start(tmp_path, "peer", config([a]))
    made = [peer]
    try:
        await until(lambda: ready(http, peer.url), 30, "peer ready")
        t0 = time.monotonic()
        starts = await asyncio.gather(
            RouterProc.start(tmp_path, "down", config([a], warm_from=["http://127.0.0.1:9"])),
            RouterProc.start(  # another admin key: refused
                tmp_path,
                "refused",
                {**config([a], warm_from=[peer.url]), "admin_key": "another-key"},
            ),
            RouterProc.start(  # another block size: its hashes would not match
                tmp_path,
                "other-bs",
                {**config([a], warm_from=[peer.url]), "block_size": 32},
            ),
        )
        made += starts
        for r in starts:
            await until(lambda r=r: ready(http, r.url), 30, f"{r.url} ready")
        assert time.monotonic() - t0 < 30  # well within warm_timeout_s (10 s) each
        down, refused, other = starts
        assert "starting cold" in down.log() and "Connect" in down.log()
        assert "HTTP 401" in refused.log() and "starting cold" in refused.log()
        assert "block size 16, not 32" in other.log() and "starting cold" in other.log()
        for r in starts:  # cold, and routing: the worker's replay gave them its events
            await until(_logged(r, "(cold)"), 10, "the cold replica's ready line")
            assert (await route(http, r.url, toks(6, 4)))["worker_id"] == "a"
    finally:
        await asyncio.gather(*(r.stop() for r in made))


def _logged(r: RouterProc, text: str) -> Any:
    async def cond() -> bool:
        return text in r.log()

    return cond


async def test_a_poisoned_snapshot_is_refused_and_the_replica_starts_cold(workers, http, tmp_path):
    """Issue 37, 2: one negative router hash in a peer's snapshot made a starting replica exit
    (the C presence table's OverflowError escaped the warm start): a corrupt peer crash-looped
    every new replica. The decoder bounds router hashes; the replica starts cold."""
    a = await workers("a")
    a.store(toks(7, 4))
    peer = await RouterProc.start(tmp_path, "peer", config([a]))
    made = [peer]
    server = None
    try:
        await until(lambda: ready(http, peer.url), 30, "peer ready")
        await until(lambda: _holds(http, peer.url, toks(7, 4)), 20, "the peer's index")
        snap = (await http.get(peer.url + SNAPSHOT_PATH, headers=ADMIN)).content
        obj = msgspec.msgpack.decode(snap)
        assert obj["workers"][0]["router_hashes"]
        obj["workers"][0]["router_hashes"][0] = -5
        poisoned = msgspec.msgpack.encode(obj)

        server = await SnapshotServer(poisoned).start()
        url = server.url
        r = await RouterProc.start(tmp_path, "r", config([a], warm_from=[url]))
        made.append(r)
        await until(lambda: ready(http, r.url), 30, "the replica ready")
        assert "not a usable index snapshot" in r.log() and "starting cold" in r.log()
    finally:
        await asyncio.gather(*(x.stop() for x in made))
        if server is not None:
            await server.aclose()


async def _holds(http: Any, url: str, tokens: list[int]) -> bool:
    return bool((await route(http, url, tokens))["matched_blocks"])
