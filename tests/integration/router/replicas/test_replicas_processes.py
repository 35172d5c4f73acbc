"""``kvrouter serve --processes 2``: two real router processes on one port (a socket the parent
bound and both inherited), each answering there and on its own port (``server.metrics_port``),
synced over ``ipc://``; a process killed is started again (warm, from its sibling), and SIGTERM
to the parent stops them all."""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import httpx
import pytest
from replica_procs import RouterProc, candidate, metric, metrics, ready, route, until

BS = 16


def toks(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(blocks * BS)]


async def process_of(http: httpx.AsyncClient, url: str) -> tuple[str, str]:
    """(process index, origin) of the process that answered ``url``'s /metrics."""
    for (name, labels), _ in (await metrics(http, url)).items():
        if name == "kvrouter_replica_info":
            d = dict(labels)
            return d["process"], d["origin"]
    raise AssertionError("no kvrouter_replica_info")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("peer_key", [False, True], ids=["plain", "peer_key"])
async def test_processes_share_one_port_sync_and_are_restarted(workers, http, tmp_path, peer_key):
    """With a peer key the siblings' ``ipc://`` sync runs CURVE too (router/runtime/replicas/
    curve.py: one rule for every transport)."""
    ws = [await workers(n) for n in ("a", "b")]
    replicas: dict[str, Any] = {"heartbeat_s": 0.1, "peer_timeout_s": 2.0}
    if peer_key:
        (tmp_path / "peer-key").write_text("0123456789abcdef" * 4)
        replicas["peer_key_file"] = str(tmp_path / "peer-key")
    config: dict[str, Any] = {
        "workers": [w.spec() for w in ws],
        "server": {"processes": 2, "metrics_port": 0},
        "replicas": replicas,
    }
    r = await RouterProc.start(tmp_path, "p", config, processes=2)
    try:
        (pid0, own0), (pid1, own1) = r.processes[0], r.processes[1]
        assert own0 and own1 and own0 != own1 and pid0 != pid1
        assert r.url not in (own0, own1)
        for own in (own0, own1):
            await until(lambda own=own: ready(http, own), 30, f"{own} ready")
        assert (await process_of(http, own0))[0] == "0"
        assert (await process_of(http, own1))[0] == "1"
        # the shared port: every new connection is accepted by one process or the other
        seen: set[str] = set()
        async with httpx.AsyncClient(
            trust_env=False, timeout=10, limits=httpx.Limits(max_keepalive_connections=0)
        ) as fresh:

            async def both() -> bool:
                seen.add((await process_of(fresh, r.url))[0])
                return seen == {"0", "1"}

            await until(both, 30, "both processes answer on the shared port")

        # synced: a prefix placed (accounted) by process 0 is predicted in process 1, once 1
        # hears 0 (a PUB drops what it sends before its subscriber's connection is up)
        await until(
            lambda: metric(http, own1, "kvrouter_replica_peers"), 30, "process 1 hears process 0"
        )
        prompt = toks(1, 20)
        first = await route(http, own0, prompt, account=True)
        w = first["worker_id"]

        async def followed() -> bool:
            ans = await route(http, own1, prompt)
            return ans["worker_id"] == w and candidate(ans, w)["predicted_blocks"] == 20

        await until(followed, 20, "process 1 follows process 0's prefix")

        # process 1 dies: started again, from its sibling's index, on the same shared port
        _, origin1 = await process_of(http, own1)
        os.kill(pid1, signal.SIGKILL)

        async def restarted() -> bool:
            return r.processes[1][0] != pid1

        await until(restarted, 30, "process 1 started again")
        _, own1b = r.processes[1]
        assert own1b is not None
        await until(lambda: ready(http, own1b), 30, "the new process 1 ready")
        again = await process_of(http, own1b)
        assert again[0] == "1" and again[1] != origin1
        assert "exited with -9: starting it again" in r.log()
        assert "warm start: index of" in r.log()
        assert alive(pid0)
        assert ("CURVE (replicas.peer_key_file)" in r.log()) == peer_key
    finally:
        rc = await r.stop()
    assert rc == 0
    assert not alive(pid0) and not alive(r.processes[1][0])
