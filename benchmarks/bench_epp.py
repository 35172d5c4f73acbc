"""The EPP hop's cost: Envoy → EPP → upstream against Envoy → upstream directly, interleaved, and
CPU seconds per 1,000 requests of the router (EPP mode and proxy mode) and of Envoy.

Run (Envoy from ``.ci/envoy.sh``'s ``.venv-envoy``, or ``KVROUTER_ENVOY_BIN``; about a minute on
the 2-core dev machine; nothing else should be running):

    python benchmarks/bench_epp.py                        # 2,000 requests per path and cell
    python benchmarks/bench_epp.py --requests 300 --cpu-requests 500      # a quick look
    python benchmarks/bench_epp.py --floor                # and the grpc.aio floor beside it
    python benchmarks/bench_epp.py --floor --response-body none   # the answer's body off the EPP
    python benchmarks/bench_epp.py --floor --floor-transport h2   # a floor with no gRPC library
    python benchmarks/bench_epp.py --concurrency 1,8,32 --json out/bench_epp.json
    taskset -c 0 python benchmarks/bench_epp.py           # every process on one core

What runs, all real processes on 127.0.0.1, every port bound 0 and read back:

- the upstream: this file with ``--serve-upstream``, a bare ASGI app on uvicorn that answers an
  OpenAI completion at once: non-streaming, one JSON body with ``usage``; streaming, 4 text
  chunks, a ``usage`` chunk and ``[DONE]`` as 6 separate SSE writes. Constant, so any
  difference is the path's.
- the router: ``kvrouter serve`` (``python -m router``) with one ``--worker`` (the upstream), its
  EPP on (``KVROUTER_EPP__PORT=0``, the port read from its log line, :mod:`kvrouter.gateway`),
  at ``--log-level warning`` (no access line per request in any mode).
- one Envoy on ``deploy/gateway/envoy.yaml`` (:func:`kvrouter.gateway.render`) with two
  listeners: ``inference`` as committed (ext_proc to the EPP, the ORIGINAL_DST cluster to the
  endpoint it names) and ``direct``, the same connection manager without ext_proc, to a STATIC
  cluster of the same upstream; with ``--floor`` a third, ``floor``: ``inference`` asking
  ``epp_floor.py`` instead, a grpc.aio picker on uvloop that does the least the protocol allows
  (``--floor-transport h2``: the same picker with gRPC's framing on ``h2`` in the loop, no gRPC
  library, to tell grpc.aio's price from the protocol's round trips).

Paths: ``epp`` (client → Envoy ``inference`` → EPP → upstream), ``direct`` (client → Envoy
``direct`` → upstream), ``floor`` (``--floor``: epp with the floor's picker, so epp minus floor is
kvrouter's own cost, the rest grpc.aio's) and, for reference, ``proxy`` (client → the router's HTTP
port → upstream: proxy mode). The client (this process, uvloop, h11 over keep-alive connections)
runs ``--concurrency`` workers; each has its own connection per path and sends one request per path
in turn, the order rotated every round, so every path sees the same machine noise. Latency is the
client's, from the request write to the response's last byte. Added latency is a path's minus
direct's, per statistic (p50, p99, mean). The issue's target: epp's added p99 <= 1 ms.

CPU: separate phases of ``--cpu-requests`` requests at concurrency 8 on one path at a time;
``/proc/<pid>/stat`` (utime + stime, :func:`kvrouter.replay.fleet.cpu_seconds`) of the picker
(the router; on path floor the floor's process) and of Envoy, per 1,000 requests.

What 2 cores can and cannot show: client, Envoy (2 worker threads), router, upstream (and the
floor) share them, so at concurrency 1 the added latency is mostly the EPP's own work plus two
loopback hops and their wake-ups (on this VM a cross-vCPU wake-up alone is tens of µs and noisy),
and at concurrency 8 it is mostly queueing for a core: the EPP's CPU per request delays everyone,
the direct path included. p99 on this VM moves by 2x between identical runs: compare paths within
one run only. CPU seconds per request are the steadier figure (per process, not machine-wide). They
cannot show throughput at scale: Envoy's many workers, the EPP's single event loop as the
bottleneck, or tail latency under production concurrency — that needs more cores than processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from children import Children  # noqa: E402
from epp_floor import FLOOR, add_floor  # noqa: E402

MODEL = "bench"
PATHS = ("direct", "floor", "epp", "proxy")  # (the tables' order)


# --------------------------------------------------------------------------- the upstream


def serve_upstream() -> None:
    """An OpenAI-shaped completion at once, streamed or not; /health, /v1/models, /metrics;
    and a KV event socket that publishes nothing (the router is ready once it connects)."""
    import uvicorn
    import zmq

    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:0")
    events = pub.getsockopt_string(zmq.LAST_ENDPOINT)

    usage = {"prompt_tokens": 1000, "completion_tokens": 4, "total_tokens": 1004,
             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    answer = json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "text": "ok ok ok ok", "finish_reason": "length"}],
        "usage": usage,
    }).encode()  # fmt: skip
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL}
    pieces = [
        {**chunk, "choices": [{"index": 0, "text": "ok ", "finish_reason": None}]} for _ in range(4)
    ] + [{**chunk, "choices": [], "usage": usage}]
    sse = [b"data: %s\n\n" % json.dumps(e).encode() for e in pieces] + [b"data: [DONE]\n\n"]
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        start = {"type": "http.response.start", "status": 200}
        if scope["method"] == "POST" and json.loads(body).get("stream"):
            head = [(b"content-type", b"text/event-stream")]
            await send({**start, "headers": head})
            for piece in sse:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        other = {"/v1/models": models}.get(scope["path"], b"{}")  # /health, /metrics
        out = answer if scope["method"] == "POST" else other
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
        await send({**start, "headers": head})
        await send({"type": "http.response.body", "body": out})

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            port = self.servers[0].sockets[0].getsockname()[1]
            print(f"upstream http://127.0.0.1:{port} events={events}", flush=True)

    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
        http="httptools", loop="uvloop",
    )  # fmt: skip
    Server(config).run()


# --------------------------------------------------------------------------- the client


class Conn:
    """One keep-alive HTTP/1.1 connection (h11 parses; chunked or not): ``post`` returns the
    seconds from the request write to the response's last byte."""

    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)

    async def open(self) -> Conn:
        import h11

        self.h11 = h11.Connection(h11.CLIENT)
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def post(self, path: str, body: bytes) -> tuple[float, bytes]:
        import h11

        c = self.h11
        head = [("host", f"{self.host}:{self.port}"), ("content-type", "application/json"),
                ("content-length", str(len(body)))]  # fmt: skip
        data = c.send(h11.Request(method="POST", target=path, headers=head))
        data += c.send(h11.Data(data=body)) + c.send(h11.EndOfMessage())  # type: ignore[operator]
        t0 = time.perf_counter()
        self.writer.write(data)
        status, got = 0, b""
        while True:
            event = c.next_event()
            if event is h11.NEED_DATA:
                c.receive_data(await self.reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                got += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError(f"{self.host}:{self.port} closed the connection")
        elapsed = time.perf_counter() - t0
        c.start_next_cycle()
        if status != 200:
            raise SystemExit(f"{path} on port {self.port}: HTTP {status}: {got[:300]!r}")
        return elapsed, got

    def close(self) -> None:
        self.writer.close()


def bodies(stream: bool) -> bytes:
    prompt = "".join(chr(97 + (i * 7919) % 26) if i % 6 else " " for i in range(1000))
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return json.dumps(body).encode()


async def interleaved(
    urls: dict[str, str], body: bytes, n: int, conc: int
) -> dict[str, list[float]]:
    """``n`` requests per path from ``conc`` workers, one per path in turn, order rotated."""
    out: dict[str, list[float]] = {p: [] for p in urls}

    async def worker(w: int) -> None:
        conns = {p: await Conn(u).open() for p, u in urls.items()}
        order = list(urls)
        try:
            for i in range(w, n, conc):
                k = i % len(order)
                for p in order[k:] + order[:k]:
                    out[p].append((await conns[p].post("/v1/completions", body))[0])
        finally:
            for c in conns.values():
                c.close()

    await asyncio.gather(*(worker(w) for w in range(conc)))
    return out


# --------------------------------------------------------------------------- the run


def stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(len(s) * 0.99))],
            "mean": statistics.fmean(s)}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:

    from kvrouter.gateway import EPP_ENV, EPP_READY, EnvoyProcess, load, render
    from kvrouter.replay.fleet import cpu_seconds
    from kvrouter.up import ROUTER_READY, answers_ok, router_argv, wait_until

    with Children("bench-epp") as kids:
        upstream, events = kids.upstream()
        argv = [
            *router_argv([f"id=up,url={upstream},events={events}"]),
            "--log-level",
            "warning",
        ]
        env = {**EPP_ENV, "KVROUTER_HEALTH__INTERVAL_S": "0.5"}
        router = kids.spawn("router", argv, env=env)
        router_url = router.wait_line(ROUTER_READY, 60, kids.stop).group(1)
        epp_port = int(router.wait_line(EPP_READY, 60, kids.stop).group(2))
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        floor = None
        if args.floor:  # the least a Python picker can cost, next to ours
            argv = [sys.executable, str(ROOT / "benchmarks" / "epp_floor.py"), "--endpoint"]
            argv += [f"{host}:{port}", "--transport", args.floor_transport]
            floor = kids.spawn("floor", argv)
            floor_port = int(floor.wait_line(EPP_READY, 60, kids.stop).group(2))

        wait_until(lambda: answers_ok(router_url + "/ready"), 60, "the router's /ready")
        head_only = args.response_body == "none"
        config = render(
            load(), epp=("127.0.0.1", epp_port), direct=(host, int(port)), head_only=head_only
        )
        if floor is not None:
            add_floor(config, ("127.0.0.1", floor_port))
        with EnvoyProcess(config, binary=args.envoy_bin, workdir=kids.tmp / "envoy") as envoy:
            urls = {"epp": envoy.url, "direct": envoy.listener_url("direct"), "proxy": router_url}
            cpu = {"router": router.proc.pid, "envoy": envoy.pid}
            if floor is not None:
                urls[FLOOR] = envoy.listener_url(FLOOR)
                cpu[FLOOR] = floor.proc.pid
            result: dict[str, Any] = _loop(
                measure(args, urls, lambda: {k: cpu_seconds(v) or 0.0 for k, v in cpu.items()})
            )
    return result


def _loop(main: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def measure(
    args: argparse.Namespace, urls: dict[str, str], cpu: Callable[[], dict[str, float]]
) -> dict[str, Any]:
    result: dict[str, Any] = {"latency": [], "cpu": [], "floor_transport": args.floor_transport}
    for stream in (False, True):
        body = bodies(stream)
        variant = "stream" if stream else "json"
        for p, u in urls.items():  # warm up every path; check each answers in full
            _, got = await _first(u, body)
            if stream and not got.rstrip().endswith(b"data: [DONE]"):
                raise SystemExit(f"{p}: the stream did not arrive whole: {got[-200:]!r}")
        await interleaved(urls, body, args.warmup, 4)
        for conc in args.concurrency:
            lat = await interleaved(urls, body, args.requests, conc)
            s = {p: stats(v) for p, v in lat.items()}
            added = {p: {k: s[p][k] - s["direct"][k] for k in s[p]} for p in s if p != "direct"}
            result["latency"].append({"variant": variant, "concurrency": conc, **s, "added": added})
        for p in urls:
            c0, t0 = cpu(), time.perf_counter()
            await interleaved({p: urls[p]}, body, args.cpu_requests, 8)
            wall, c1 = time.perf_counter() - t0, cpu()
            per_k = 1000 / args.cpu_requests
            picker = FLOOR if p == FLOOR else "router"  # (the process that picks on this path)
            result["cpu"].append({
                "variant": variant, "path": p, "requests": args.cpu_requests,
                "req_per_s": args.cpu_requests / wall,
                "router_s_per_1k": (c1[picker] - c0[picker]) * per_k,
                "envoy_s_per_1k": (c1["envoy"] - c0["envoy"]) * per_k,
            })  # fmt: skip
    return result


async def _first(url: str, body: bytes) -> tuple[float, bytes]:
    c = await Conn(url).open()
    try:
        return await c.post("/v1/completions", body)
    finally:
        c.close()


def markdown(result: dict[str, Any]) -> str:
    ms = lambda x: f"{x * 1e3:.2f}"  # noqa: E731
    us = lambda x: f"{x * 1e6:+.0f}"  # noqa: E731
    lines = [
        "Latency (ms, client-observed; added = path - direct, µs; target: epp's added p99 <= "
        f"1,000 µs; floor: the least picker on {result['floor_transport']})",
        "",
        "| variant | conc | path | p50 / p99 / mean | added p50 | added p99 | added mean |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for r in result["latency"]:
        for p in PATHS:
            if p in r:
                a = r["added"].get(p)
                add = " | ".join(us(a[k]) for k in ("p50", "p99", "mean")) if a else "| |"
                cells = " / ".join(ms(r[p][k]) for k in ("p50", "p99", "mean"))
                lines.append(f"| {r['variant']} | {r['concurrency']} | {p} | {cells} | {add} |")
    lines += [
        "",
        "CPU seconds per 1,000 requests (concurrency 8, one path at a time; picker: the router, "
        "or the floor's process on path floor)",
        "",
        "| variant | path | req/s | picker | Envoy | picker + Envoy |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["cpu"]:
        rt, ev = r["router_s_per_1k"], r["envoy_s_per_1k"]
        lines.append(f"| {r['variant']} | {r['path']} | {r['req_per_s']:.0f} | {rt:.2f} | "
                     f"{ev:.2f} | {rt + ev:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="per path, variant, concurrency")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated (default 1,8)")
    ap.add_argument("--cpu-requests", type=int, default=2000, help="per path and variant")
    ap.add_argument("--warmup", type=int, default=200, help="per path and variant")
    ap.add_argument("--envoy-bin", help="default: $KVROUTER_ENVOY_BIN, else .venv-envoy's")
    ap.add_argument("--json", metavar="PATH", help="write the figures here too")
    ap.add_argument("--floor", action="store_true", help="path floor too (epp_floor.py)")
    ap.add_argument(
        "--floor-transport",
        choices=("grpc", "h2"),
        default="grpc",
        help="the floor's server: grpc.aio, as the router's EPP (default), or gRPC's framing on "
        "h2 with no gRPC library (epp_floor.py --transport h2; needs `pip install h2`)",
    )
    ap.add_argument(
        "--response-body",
        choices=("streamed", "none"),
        default="streamed",
        help="the ext_proc response_body_mode (default streamed, as committed; none: the EPP "
        "sees the answer's headers and its end, not its body — no usage, the first byte at the "
        "headers)",
    )
    ap.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream()
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    result = run(args)
    print(markdown(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1))


if __name__ == "__main__":
    main()
