"""HTTP floors on this machine: what ``bench_route.py``'s numbers would be with no router work.

Run (about 40 s; nothing else should be running):

    python benchmarks/bench_http_floor.py
    taskset -c 0 python benchmarks/bench_http_floor.py      # every process on one core

Two stand-ins, measured with ``bench_route.py``'s own client and request shapes:

1. route floor: a bare uvloop + httptools server that reads the same ~28 KB ``/route`` body
   (4,096 token ids) and answers a fixed 2.7 KB JSON, one request at a time over one keep-alive
   connection. ``bench_route.py``'s ``/route`` minus this is the router's own cost.
2. proxy floor: a bare forwarder (same server, the router's own upstream client) between the
   client and ``bench_route.py``'s worker, alternating with direct calls at ``--rate``
   requests/s. Its added latency is the price of one more hop with no routing at all.

``--serve-asgi h11|httptools`` serves the same fixed answer as a bare ASGI app on uvicorn, with
the router's own server settings (``router.edge.server``): what the maintained server alone costs.
``bench_vs_dynamo.py --floors`` measures both next to the router and Dynamo in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_route import Client, pct, spawn  # noqa: E402

ANSWER = b"{" + b'"x": 1, ' * 340 + b'"end": 0}'  # about the size of a /route answer


def serve(upstream: str | None) -> None:
    """The bare server: a fixed answer, or (``upstream``) the body forwarded there."""
    import httptools
    import uvloop

    from router.fleet.upstream import UpstreamPool

    pool = UpstreamPool(connect_s=2, read_s=30, write_s=30)

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]
            self.parser = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            body, self.body = b"".join(self.body), []
            if upstream is None:
                self.reply(ANSWER)
            else:
                asyncio.get_running_loop().create_task(self.forward(body))

        async def forward(self, body: bytes) -> None:
            headers = [("Content-Type", "application/json")]
            resp = await pool.request(upstream, "POST", "/v1/completions", headers, body)  # type: ignore[arg-type]
            try:
                self.reply(await resp.read())
            finally:
                await resp.aclose()

        def reply(self, data: bytes) -> None:
            head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            )
            self.transport.write(head % len(data) + data)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0)
        print(f"floor http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    uvloop.run(main())


def serve_asgi(http: str) -> None:
    """The fixed answer from a bare ASGI app on uvicorn (``http``: its h11 or httptools
    protocol), served as the router is: ``router.edge.server.server_config`` (default settings) and
    ``RouterServer``."""
    from types import SimpleNamespace

    import uvloop

    from router.edge.server import RouterServer, server_config
    from router.settings import load_settings

    class Floor:
        state = SimpleNamespace(settings=load_settings(environ={}))

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            while (await receive()).get("more_body"):
                pass
            head = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(ANSWER)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": ANSWER})

    config = server_config(
        Floor(), host="127.0.0.1", port=0, http=http, lifespan="off", log_level="warning"
    )
    server = RouterServer(config)

    async def main() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"floor http://127.0.0.1:{port}", flush=True)
        await task

    uvloop.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--queries", type=int, default=5000, help="route-floor requests per round")
    ap.add_argument("--seconds", type=float, default=10.0, help="proxy-floor time per round")
    ap.add_argument("--rate", type=float, default=100.0, help="proxy-floor requests per second")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", nargs="?", const="", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-asgi", choices=["h11", "httptools"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve or None)
        return
    if args.serve_asgi is not None:
        serve_asgi(args.serve_asgi)
        return
    me = str(Path(__file__).resolve())
    procs: list[subprocess.Popen[str]] = []
    try:
        server, url = spawn([sys.executable, me, "--serve"], r"floor (http://\S+)")
        procs.append(server)
        worker, worker_url = spawn(
            [sys.executable, str(ROOT / "benchmarks" / "bench_route.py"), "--serve-worker"],
            r"worker (http://\S+)",
        )
        procs.append(worker)
        forwarder, fwd_url = spawn(
            [sys.executable, me, "--serve", worker_url], r"floor (http://\S+)"
        )
        procs.append(forwarder)

        rng = random.Random(1)
        body = json.dumps({"token_ids": [rng.randrange(50_000) for _ in range(4096)]}).encode()
        c = Client(url)
        for _ in range(300):
            c.call("POST", "/route", body)
        route = []
        for _ in range(args.rounds):
            lat = [c.call("POST", "/route", body)[2] for _ in range(args.queries)]
            route.append((pct(lat, 0.5), pct(lat, 0.99)))

        prompt = "".join(random.Random(2).choice("abcdefgh ") for _ in range(1000))
        body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 1}).encode()
        direct, fwd = Client(worker_url), Client(fwd_url)
        for _ in range(200):
            direct.call("POST", "/v1/completions", body)
            fwd.call("POST", "/v1/completions", body)
        added = []
        for _ in range(args.rounds):
            d: list[float] = []
            f: list[float] = []
            t0 = time.perf_counter()
            for i in range(int(args.seconds * args.rate)):
                delay = t0 + i / args.rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                if i % 2 == 0:
                    d.append(direct.call("POST", "/v1/completions", body)[2])
                else:
                    f.append(fwd.call("POST", "/v1/completions", body)[2])
            added.append((pct(f, 0.5) - pct(d, 0.5), pct(f, 0.99) - pct(d, 0.99)))
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    print(f"\n{'floor':<40}{'p50':>10}{'p99':>10}   per round p50/p99 (us)")
    for name, per in (
        ("bare server, /route-sized request", route),
        ("bare forwarder, added", added),
    ):
        p50 = statistics.median(x[0] for x in per)
        p99 = statistics.median(x[1] for x in per)
        each = "  ".join(f"{a * 1e6:.0f}/{b * 1e6:.0f}" for a, b in per)
        print(f"{name:<40}{p50 * 1e6:>8.0f}us{p99 * 1e6:>8.0f}us   {each}")


if __name__ == "__main__":
    main()
