"""Warm start vs cold start of a router replica (issue 23): how long until it is ready, and what
its index holds then.

    python benchmarks/bench_warm_start.py                        # 4 workers x 20,000 blocks
    python benchmarks/bench_warm_start.py --workers 8 --blocks 50000

A small fleet of fake workers (``tests/integration/router/router_fakeworker.py``: real HTTP,
real ZMQ PUB and replay ROUTER) each store ``--blocks`` blocks in prompts of 100 blocks; a peer
router (``python -m router``) indexes them all. Then new routers start, each timed from its spawn
to ``/ready`` and to its "ready ... after start" log line (every worker's stream live):

- ``cold, full replay``: the workers still hold every batch, so the replay rebuilds the index;
- ``warm``: ``replicas.warm_from`` the peer (its ``/admin/snapshot``), then a resume that checks
  one batch per worker;
- ``cold, bounded replay`` / ``warm, bounded replay``: the workers' replay buffers keep their last
  batch only (as vLLM's bounded buffer does after a while): a cold start learns nothing older.

Printed per start: seconds to ``/ready``, seconds to every stream live, index blocks then, and the
matched blocks of the first ``/route`` for a prefix stored at the beginning. Measured, never
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import httpx
import yaml
import zmq.asyncio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration" / "router")]

from router_fakeworker import FakeWorker  # noqa: E402

LINE = re.compile(rb"kvrouter router listening on (http://127\.0\.0\.1:\d+)")
READY = re.compile(r"ready ([\d.]+) s after start \(([^)]*)\), index of (\d+) blocks")
KEY = "bench-admin-key"
BS = 16


async def start_router(
    tmp: Path, name: str, cfg: dict
) -> tuple[asyncio.subprocess.Process, str, float, Path]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"admin_key": KEY, "health": {"interval_s": 0.2}, **cfg}))
    log = tmp / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.monotonic()
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router", "serve", "--config", str(path), "--port", "0",
            stdout=asyncio.subprocess.PIPE, stderr=err, env=env, cwd=str(ROOT),
        )  # fmt: skip
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        m = LINE.search(line)
        if m:
            return proc, m.group(1).decode(), t0, log


async def timed_start(
    http: httpx.AsyncClient, tmp: Path, name: str, cfg: dict, probe: list[int]
) -> dict:
    proc, url, t0, log = await start_router(tmp, name, cfg)
    while (await http.get(url + "/ready")).status_code != 200:
        await asyncio.sleep(0.01)
    t_ready = time.monotonic() - t0
    while not READY.search(log.read_text()):
        await asyncio.sleep(0.01)
    m = READY.search(log.read_text())
    assert m is not None
    first = (await http.post(url + "/route", json={"token_ids": probe})).json()
    proc.terminate()
    await proc.wait()
    return {
        "start": name,
        "to /ready s": round(t_ready, 2),
        "streams live s (after app start)": float(m.group(1)),
        "index blocks": int(m.group(3)),
        "first /route matched": first["matched_blocks"],
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=20_000, help="blocks stored per worker")
    args = ap.parse_args()
    ctx = zmq.asyncio.Context()
    tmp = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    workers = [await FakeWorker(f"w{i}", ctx).start() for i in range(args.workers)]
    rng = random.Random(0)
    probe: list[int] = []
    for w in workers:
        for _ in range(args.blocks // 100):
            tokens = [rng.randrange(256) for _ in range(100 * BS)]
            probe = probe or tokens
            w.store(tokens)
    total = args.workers * (args.blocks // 100) * 100
    fleet = {"workers": [w.spec() for w in workers]}
    rows = []
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        peer, peer_url, _, _ = await start_router(tmp, "peer", fleet)
        while True:  # the peer has indexed everything
            text = (await http.get(peer_url + "/metrics")).text
            blocks = sum(
                float(x)
                for x in re.findall(
                    r'^kvrouter_index_blocks\{[^}]*tier="GPU"[^}]*\} (\S+)', text, re.M
                )
            )
            if blocks >= total:
                break
            await asyncio.sleep(0.1)
        warm = {**fleet, "replicas": {"warm_from": [peer_url], "warm_timeout_s": 60}}
        rows.append(await timed_start(http, tmp, "cold, full replay", fleet, probe))
        rows.append(await timed_start(http, tmp, "warm", warm, probe))
        for w in workers:  # bounded replay buffers: the last batch only
            w.buffer = deque(list(w.buffer)[-1:], maxlen=10_000)
        rows.append(await timed_start(http, tmp, "cold, bounded replay", fleet, probe))
        rows.append(await timed_start(http, tmp, "warm, bounded replay", warm, probe))
        peer.terminate()
        await peer.wait()
    for w in workers:
        await w.aclose()
    ctx.destroy(linger=0)
    print(f"{args.workers} workers x {args.blocks // 100 * 100} blocks ({total} in the index)")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))


if __name__ == "__main__":
    asyncio.run(main())
