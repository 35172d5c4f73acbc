"""Replica sync under the peer key between real router processes over TCP (issue 37, trust): the
configured ``replicas.peer_key_file`` puts CURVE on the sync sockets; a replica with the same key
follows what its peer placed, one with another key is refused at the handshake (counted on both
sides, by reason) and hears nothing."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from replica_procs import RouterProc, candidate, metric, ready, route, until

BS = 16
PUBLISHING = re.compile(r"publishing on (tcp://127\.0\.0\.1:\d+), peers .*, CURVE")


def cfg(workers: list[Any], key: Path, peers: list[str]) -> dict:
    return {
        "workers": [w.spec() for w in workers],
        "scoring": {"replica_spread": 0},
        "replicas": {
            "sync_bind": "tcp://127.0.0.1:0",
            "peers": peers,
            "peer_key_file": str(key),
            "heartbeat_s": 0.1,
            "peer_timeout_s": 2.0,
        },
    }


async def test_routers_with_the_peer_key_sync_and_another_key_is_refused(workers, http, tmp_path):
    ws = [await workers(n) for n in ("a", "b")]
    key, other = tmp_path / "peer-key", tmp_path / "other-key"
    key.write_text("0123456789abcdef" * 4 + "\n")
    other.write_text("fedcba9876543210" * 4 + "\n")
    one = await RouterProc.start(tmp_path, "one", cfg(ws, key, []))
    routers = [one]
    try:
        await until(lambda: ready(http, one.url), 30, "one ready")
        found = PUBLISHING.search(one.log())  # (its sync port: bound 0, read back)
        assert found, one.log()[-2000:]
        ep = found.group(1)
        two, stranger = await asyncio.gather(
            RouterProc.start(tmp_path, "two", cfg(ws, key, [ep])),
            RouterProc.start(tmp_path, "stranger", cfg(ws, other, [ep])),
        )
        routers += [two, stranger]
        for r in (two, stranger):
            await until(lambda r=r: ready(http, r.url), 30, f"{r.url} ready")
        await until(lambda: metric(http, two.url, "kvrouter_replica_peers"), 30, "two hears one")

        async def failed(r: RouterProc) -> float:
            n = 0.0
            for reason in ("auth", "crypto", "mechanism", "other"):
                n += await metric(
                    http, r.url, "kvrouter_replica_sync_handshakes_failed_total", reason=reason
                )
            return n

        async def refused() -> bool:  # (crypto on one's side, as a rule; no detail if rushed)
            return await failed(one) >= 1 and await failed(stranger) >= 1

        await until(refused, 30, "the stranger refused at the handshake, counted on both sides")
        prompt = [i % 256 for i in range(24 * BS)]
        first = await route(http, one.url, prompt, account=True)
        w = first["worker_id"]

        async def predicted() -> bool:
            ans = await route(http, two.url, prompt)
            return bool(candidate(ans, w)["predicted_blocks"] == 24)

        await until(predicted, 20, "two sees one's placement")
        assert await metric(http, stranger.url, "kvrouter_replica_peers") == 0
        assert await metric(http, stranger.url, "kvrouter_replica_sync_received_total") == 0
        ans = await route(http, stranger.url, prompt)
        assert candidate(ans, w)["predicted_blocks"] == 0  # it learnt nothing of one's placement
        assert "replica sync: handshake with a subscriber on tcp://127.0.0.1:" in one.log()
    finally:
        await asyncio.gather(*(r.stop() for r in routers))
