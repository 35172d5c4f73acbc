"""``kvrouter serve --processes 2`` against 1: proxied streaming throughput, latency and router
CPU seconds per 1,000 requests, against a fast upstream (issue 23's "scale on this machine").

Run (about 60 s with the defaults; nothing else should be running):

    python benchmarks/bench_processes.py
    python benchmarks/bench_processes.py --seconds 10 --concurrency 16     # a quick look
    python benchmarks/bench_processes.py --processes 1,2,4 --json out/bench_processes.json

What runs, all real processes on 127.0.0.1, every port bound 0 and read back:

- the upstream: ``bench_epp.py --serve-upstream`` (a bare ASGI app on uvicorn + uvloop that
  streams an OpenAI completion at once: 4 text chunks, a usage chunk, ``[DONE]``), constant, so
  any difference is the router's;
- the router: ``kvrouter serve`` (``python -m router``) with one ``--worker`` (the upstream) at
  ``--log-level warning``, once per ``--processes`` value, fresh each time: with N > 1 the
  supervisor and N processes synced over ``ipc://`` on one inherited listening socket, ready
  once every process has printed its line and ``/ready`` answers;
- the client: this process on uvloop, ``--concurrency`` workers, each on a keep-alive connection
  of its own opened after the router is ready (the kernel hands each to whichever process accepts
  first), sending streamed ``/v1/completions`` back to back: ``--warmup`` seconds unmeasured,
  then ``--seconds`` measured.

Per cell: requests per second, client latency (request write to last byte) p50/p99, and the
router's CPU seconds per 1,000 requests (``/proc`` utime + stime of the router and its
descendants, :func:`kvrouter.replay.fleet.cpu_seconds`: the supervisor, which only relays
lines, included).

What a 2-core machine can and cannot show: client, upstream and router processes share two
cores, so one router process already competes with the client and the upstream for them; a second
process can use only what those leave idle, and mostly shows what sync and a second event loop
*cost* (CPU per request: each placement is also published to and applied by the peer) rather than
what they buy. Throughput with ``--processes 2`` can come out flat or even lower here; the gain
a multi-core router machine would see (one process pinned at 100 % of a core, the second taking
the rest) needs more cores than processes plus the client and upstream. Connection spreading is by
accept order, not balanced: with few connections one process may serve most of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_epp import Conn, _loop, bodies, stats  # noqa: E402
from children import Children  # noqa: E402

#: one of ``--processes N``'s processes serves (router.cli prints it)


async def load(url: str, body: bytes, conc: int, warmup: float, seconds: float, cpu: Any) -> dict:
    """``conc`` workers back to back; what the measured window saw."""
    lat: list[float] = []
    measuring = False
    stop_at = float("inf")  # (0 once measured: each worker ends after its request in flight)

    async def worker() -> None:
        conn = await Conn(url).open()
        try:
            while time.perf_counter() < stop_at:
                elapsed, _ = await conn.post("/v1/completions", body)
                if measuring:
                    lat.append(elapsed)
        finally:
            conn.close()

    tasks = [asyncio.create_task(worker()) for _ in range(conc)]
    await asyncio.sleep(warmup)  # a time window, not a wait for state
    measuring, cpu0, t0 = True, cpu(), time.perf_counter()
    await asyncio.sleep(seconds)
    measuring, cpu1, t1 = False, cpu(), time.perf_counter()
    stop_at = 0.0
    await asyncio.gather(*tasks)
    n = len(lat)
    return {
        "requests": n,
        "req_s": n / (t1 - t0),
        **{f"{k}_ms": v * 1e3 for k, v in stats(lat).items()},
        "router_cpu_s_per_1k": (cpu1 - cpu0) / n * 1000 if n else float("nan"),
        "router_cores": (cpu1 - cpu0) / (t1 - t0),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:

    from kvrouter.replay.fleet import cpu_seconds
    from kvrouter.up import PROCESS_READY, ROUTER_READY, answers_ok, router_argv, wait_until

    out = []
    body = bodies(stream=True)
    with Children("bench-processes") as kids:
        upstream, events = kids.upstream()
        for n in args.processes:
            argv = [*router_argv([f"id=up,url={upstream},events={events}"])]
            argv += ["--log-level", "warning", "--processes", str(n)]
            router = kids.spawn(f"router-{n}", argv)
            url = router.wait_line(ROUTER_READY, 60, kids.stop).group(1)
            for _ in range(n - 1):
                router.wait_line(PROCESS_READY, 60, kids.stop)

            wait_until(lambda url=url: answers_ok(url + "/ready"), 60, "the router's /ready")
            pid = router.proc.pid
            cell = _loop(
                load(
                    url,
                    body,
                    args.concurrency,
                    args.warmup,
                    args.seconds,
                    lambda pid=pid: cpu_seconds(pid) or 0.0,
                )
            )
            out.append({"processes": n, "concurrency": args.concurrency, **cell})
            kids.end(router)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| processes | conc | requests | req/s | p50 ms | p99 ms | router CPU-s/1k | router cores |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['processes']} | {r['concurrency']} | {r['requests']} | {r['req_s']:.0f} | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['router_cpu_s_per_1k']:.3f} | "
            f"{r['router_cores']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", default="1,2", help="router processes per cell (default 1,2)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured per cell (default 20)")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    args.processes = [int(x) for x in args.processes.split(",") if x]
    rows = run(args)
    print(markdown(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
