"""Flood benchmark: one worker publishes valid BlockStored events of distinct blocks as fast as it
can against a real router process. What does it cost the router (RSS growth) and the other
workers (a bystander's store -> visible on ``POST /route``, p99)? Issue 21, item 5.

    python benchmarks/bench_flood.py                    # this checkout, a 20 s flood
    python benchmarks/bench_flood.py --capacity 0       # the flooder reports no KV capacity
    git archive HEAD | tar -x -C /tmp/before && cp indexer/*.so /tmp/before/indexer/ \\
      && cp router/*.so /tmp/before/router/                 # another checkout, C parts built
    python benchmarks/bench_flood.py --checkout /tmp/before  # before/after: same flood, same box

The router is ``python -m router`` run from ``--checkout`` (its packages first on the path),
with two workers served by this script (``/health``, ``/v1/models``, ``/metrics``, a ZMQ PUB):

- ``flood``, in its own process: messages of 4 BlockStored of 16 blocks, each a new chain from
  the root with tokens never used before (every block distinct), as fast as it can for
  ``--seconds`` (PUB without a send limit: nothing is dropped, the router's TCP window paces
  it). Its ``/metrics`` says ``vllm:cache_config_info{num_gpu_blocks="--capacity"}`` as vLLM does.
- ``quiet``: every ``--probe-every`` seconds it stores a new 4-block prompt, and this script
  polls ``/route`` until the router shows it on ``quiet``: the store -> visible latency.

Printed: the router's RSS (``/proc/<pid>/status`` VmRSS) before the flood, its peak, and once the
flood is applied; the blocks flooded, the flooder's entries in the index and the evictions (from
the router's ``/metrics``); bystander latency p50/p99/max. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from indexer.events import BlockStored  # noqa: E402
from indexer.wire import encode_message, encode_payload  # noqa: E402

BS = 16
TOPIC = b"kv-events"
_TASKS: set[asyncio.Future[Any]] = set()  # the workers' HTTP servers


def _flooder(conn: Any, seconds: float) -> None:  # child process
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:*")
    conn.send(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    seq = 0
    empty = encode_payload([], ts=time.time(), dp_rank=0)
    while not conn.poll(0.01):  # empty batches until the router hears us (slow joiner)
        pub.send_multipart(encode_message(TOPIC, seq, empty))
        seq += 1
    conn.recv()
    token, ehash, blocks = 1, 1, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        events = []
        for _ in range(4):
            tokens = list(range(token, token + 16 * BS))
            token += 16 * BS
            events.append(BlockStored(list(range(ehash, ehash + 16)), None, tokens, BS))
            ehash += 16
            blocks += 16
        pub.send_multipart(encode_message(TOPIC, seq, encode_payload(events, ts=time.time())))
        seq += 1
    conn.send((blocks, seq))
    conn.recv()  # until the parent is done
    pub.close(linger=0)
    ctx.term()


def _http_app(metrics: str) -> Any:
    bodies = {
        "/health": (b"application/json", b'{"status":"ok"}'),
        "/v1/models": (b"application/json", json.dumps({"data": [{"id": "m"}]}).encode()),
        "/metrics": (b"text/plain; version=0.0.4", metrics.encode()),
    }

    async def app(scope: dict, receive: Any, send: Any) -> None:
        kind, body = bodies.get(scope["path"], (b"text/plain", b""))
        status = 200 if scope["path"] in bodies else 404
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind)]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    return app


async def _serve(app: Any) -> tuple[uvicorn.Server, str]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    _TASKS.add(asyncio.ensure_future(server.serve()))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` carrying ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def run(args: argparse.Namespace) -> None:
    mpctx = mp.get_context("spawn")
    conn, child = mpctx.Pipe()
    proc = mpctx.Process(target=_flooder, args=(child, args.seconds), daemon=True)
    proc.start()
    flood_ep = conn.recv()
    zctx = zmq.asyncio.Context()
    quiet_pub = zctx.socket(zmq.PUB)
    quiet_pub.bind("tcp://127.0.0.1:*")
    quiet_ep = quiet_pub.getsockopt_string(zmq.LAST_ENDPOINT)
    cap = ""
    if args.capacity:
        cap = ('vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",'
               f'num_cpu_blocks="None",num_gpu_blocks="{args.capacity}"}} 1.0\n')  # fmt: skip
    flood_http, flood_url = await _serve(_http_app(cap))
    quiet_http, quiet_url = await _serve(_http_app(""))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [
        {"id": "flood", "url": flood_url, "events_endpoint": flood_ep},
        {"id": "quiet", "url": quiet_url, "events_endpoint": quiet_ep},
    ]
    cfg = {"port": port, "log_level": "warning", "health": {"interval_s": 0.5},
           "workers": workers}  # fmt: skip
    checkout = str(Path(args.checkout).resolve())
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(cfg, f)  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": checkout}
    router = subprocess.Popen(
        [sys.executable, "-m", "router", "--config", f.name], cwd=checkout, env=env
    )
    url = f"http://127.0.0.1:{port}"
    seq = 0
    rng = random.Random(1)
    lat: list[float] = []
    timeouts = 0
    try:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:

            async def metrics() -> str:
                return (await http.get(url + "/metrics")).text

            async def store_and_wait(limit: float) -> float | None:
                nonlocal seq
                tokens = [rng.randrange(256) for _ in range(4 * BS)]
                ev = BlockStored([rng.getrandbits(62) for _ in range(4)], None, tokens, BS)
                t0 = time.perf_counter()
                await quiet_pub.send_multipart(
                    encode_message(TOPIC, seq, encode_payload([ev], ts=time.time()))
                )
                seq += 1
                while time.perf_counter() - t0 < limit:
                    r = await http.post(url + "/route", json={"token_ids": tokens})
                    if r.status_code == 200:
                        c = [x for x in r.json()["candidates"] if x["worker_id"] == "quiet"]
                        if c and c[0]["matched_blocks"] == 4:
                            return time.perf_counter() - t0
                    await asyncio.sleep(0.002)
                return None

            t_start = time.monotonic()
            while True:  # the router up, subscribed to both, and the quiet stream live
                try:
                    text = await metrics()
                    if _metric(text, "kvrouter_events_messages_total", worker="flood") > 0 and (
                        await store_and_wait(0.5) is not None
                    ):
                        break
                except httpx.HTTPError:
                    pass
                if router.poll() is not None or time.monotonic() - t_start > 60:
                    raise SystemExit("the router did not come up")
                await asyncio.sleep(0.1)
            await asyncio.sleep(2 * 0.5)  # two health rounds: the flooder's capacity read
            rss0 = peak = _rss(router.pid)
            conn.send("go")
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                got = await store_and_wait(10.0)
                if got is None:
                    timeouts += 1
                else:
                    lat.append(got)
                peak = max(peak, _rss(router.pid))
                await asyncio.sleep(args.probe_every)
            blocks, last_seq = conn.recv()
            while True:  # until the router applied the whole flood
                text = await metrics()
                peak = max(peak, _rss(router.pid))
                done = _metric(text, "kvrouter_event_last_seq", worker="flood") >= last_seq - 1
                if done or time.monotonic() - t0 > args.seconds + 120:
                    break
                await asyncio.sleep(0.2)
            rss1 = _rss(router.pid)
            entries = _metric(text, "kvrouter_index_blocks", worker="flood")
            evicted = _metric(text, "kvrouter_index_evicted_entries_total", worker="flood")
            drained = time.monotonic() - t0
    finally:
        conn.send("bye")
        router.terminate()
        router.wait(10)
        os.unlink(f.name)
        flood_http.should_exit = quiet_http.should_exit = True
        quiet_pub.close(linger=0)
        zctx.term()
        proc.join(5)
    lat.sort()
    mib = 1 << 20
    print(f"\n## flood: {args.seconds:g} s, capacity {args.capacity or 'not reported'}, "
          f"router from {checkout}\n")  # fmt: skip
    print("| blocks flooded | applied after (s) | flooder entries | evicted | RSS before MiB |"
          " RSS peak MiB | RSS after MiB | growth MiB (peak) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {blocks:,} | {drained:.1f} | {entries:,.0f} | {evicted:,.0f} | {rss0 / mib:.0f} | "
          f"{peak / mib:.0f} | {rss1 / mib:.0f} | {(rss1 - rss0) / mib:.0f} "
          f"({(peak - rss0) / mib:.0f}) |")  # fmt: skip
    if lat:
        p = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(f"\nbystander store -> visible on /route: n={len(lat)} p50 "
              f"{statistics.median(lat) * 1e3:.1f} ms, p99 {p * 1e3:.1f} ms, "
              f"max {lat[-1] * 1e3:.1f} ms, over 10 s: {timeouts}")  # fmt: skip
    print("\ntarget: bounded RSS growth, bystander p99 < 500 ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", default=str(ROOT), help="the kvrouter tree whose router runs")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--capacity", type=int, default=32768,
                    help="GPU blocks the flooder reports (0: none)")  # fmt: skip
    ap.add_argument("--probe-every", type=float, default=0.05)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
