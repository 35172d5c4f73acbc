"""Router benchmark: ``/route`` latency, and the latency the OpenAI proxy adds.

Run (about a minute on the 2-core dev machine; nothing else should be running):

    python benchmarks/bench_route.py                       # both parts, 3 rounds each, table + PNG
    python benchmarks/bench_route.py --only route --queries 20000 --rounds 5
    python benchmarks/bench_route.py --only proxy --seconds 30 --rate 100
    taskset -c 0 python benchmarks/bench_route.py --only route   # every process on one core

Each part runs ``--rounds`` rounds (default 3) and reports the median round, with every round's
p50/p99 beside it: on the 2-vCPU dev VM single rounds move by 2x. On that VM a wake-up across
vCPUs is also slow and noisy (the host steals the idle one), so ``taskset -c 0`` — client, router
and worker sharing one core, every hand-off a plain context switch — is the steadier view of the
router's own cost; report which one a figure comes from.

Everything is real and on 127.0.0.1: the router is ``python -m router`` in its own process, the
worker is a minimal OpenAI server (this file with ``--serve-worker``) in another, and the KV events
come from 8 ZMQ PUB sockets in this process.

1. route: 8 workers each announce 16 random-length prefixes (up to 32,768 tokens) of 64 shared
   documents (4 system prompts shared by groups of documents) — the state of
   ``index_workloads.py``'s match benchmark (``bench_ingest.py --only match``), delivered as its ingest stream shape (vLLM >= 0.24 wire
   format, 16-token blocks, 16 blocks per chained ``BlockStored``). Then ``POST /route`` with
   ``token_ids`` of a document's first 4,096 tokens (256 blocks), one request at a time over one
   keep-alive connection (a raw-socket HTTP/1.1 client); latency measured by the client, from
   the request write to the last response byte.
   Target: p99 <= Dynamo's ``/query`` p99 for the same shape (438 µs on this machine once);
   ``bench_vs_dynamo.py`` measures both side by side in one run, on this state (with engine
   hashes derived from content, which Dynamo needs).
2. proxy: ``POST /v1/completions`` (a 1,000-byte prompt, non-streaming) paced at ``--rate``
   requests/s, alternating direct-to-worker and through-the-router requests so both see the same
   machine noise. Reported: p50/p99 of each and the difference. Target: p99 added <= 2 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKERS = 8
DOCS_PER_WORKER = 16


# --------------------------------------------------------------------------- processes


def serve_worker() -> None:
    """The minimal OpenAI worker: fixed answers, no model, so only HTTP costs are measured."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    answer = json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": "bench",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                      "prompt_tokens_details": {"cached_tokens": 0}},
        }
    ).encode()  # fmt: skip

    async def completions(request):  # type: ignore[no-untyped-def]
        await request.body()
        return Response(answer, media_type="application/json")

    async def health(request):  # type: ignore[no-untyped-def]
        return Response(b'{"status":"ok"}', media_type="application/json")

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health),
        ]
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):  # type: ignore[no-untyped-def]
            await super().startup(sockets)
            port = self.servers[0].sockets[0].getsockname()[1]
            print(f"worker http://127.0.0.1:{port}", flush=True)

    Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")).run()


def spawn(args: list[str], pattern: str) -> tuple[subprocess.Popen[str], str]:
    # a loopback benchmark reads GET /workers: the admin endpoints opened explicitly
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVROUTER_ADMIN_OPEN="true")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(pattern, line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise SystemExit(f"{args[:3]} did not start")


class Client:
    """One keep-alive HTTP/1.1 connection over a raw socket (answers must carry Content-Length):
    a lighter client than http.client, so less of the measured time is the client's own."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host = f"{host}:{port}".encode()

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, float]:
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode(), path.encode(), self.host)
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        req = head + b"\r\n" + (body or b"")
        t0 = time.perf_counter()
        self.sock.sendall(req)
        buf = b""
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            buf += chunk
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                continue
            lower = buf[:end].lower()
            i = lower.find(b"content-length:")
            n = int(lower[i + 15 :].split(b"\r\n", 1)[0])
            if len(buf) >= end + 4 + n:
                break
        elapsed = time.perf_counter() - t0
        return int(buf[9:12]), buf[end + 4 : end + 4 + n], elapsed


def _histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(name + "_count"):
            count = float(line.split()[-1])
    return total, count


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- route


def build_stream(seed: int = 0) -> tuple[list[list[list]], list[list[int]]]:
    """Per worker, its BlockStored events (one per message): ``index_workloads.py``'s match state."""
    from index_workloads import match_workload

    docs, events = match_workload(WORKERS, DOCS_PER_WORKER, seed)
    streams: list[list[list]] = [[] for _ in range(WORKERS)]
    for w, ev in events:
        streams[w].append([ev])
    return streams, docs


def bench_route(queries: int, rounds: int, worker_url: str) -> dict[str, float]:
    import zmq

    from indexer.wire import encode_message, encode_payload

    streams, docs = build_stream()
    ctx = zmq.Context()
    pubs = []
    for _ in range(WORKERS):
        p = ctx.socket(zmq.PUB)
        p.setsockopt(zmq.SNDHWM, 0)
        p.bind("tcp://127.0.0.1:*")
        pubs.append(p)
    specs = []
    for w, p in enumerate(pubs):
        ep = p.getsockopt_string(zmq.LAST_ENDPOINT)
        specs += ["--worker", f"id=w{w},url={worker_url},events={ep}"]
    router, url = spawn(
        [sys.executable, "-m", "router", "--port", "0", "--log-level", "warning", *specs],
        r"listening on (http://\S+)",
    )
    try:
        c = Client(url)
        seqs = [0] * WORKERS

        def messages() -> list[int]:
            ws = json.loads(c.call("GET", "/workers")[1])["workers"]
            return [w["ranks"][0]["subscriber"]["messages"] for w in ws]

        # slow joiners: empty batches until every subscriber has seen one, then the stream
        probe = encode_payload([], ts=time.time(), dp_rank=0)
        deadline = time.monotonic() + 60
        while min(messages()) == 0:
            if time.monotonic() > deadline:
                raise SystemExit("subscribers never received events")
            for w, p in enumerate(pubs):
                p.send_multipart(encode_message(b"", seqs[w], probe))
                seqs[w] += 1
            time.sleep(0.02)
        t0 = time.perf_counter()
        sent = 0
        for w, p in enumerate(pubs):
            for ev in streams[w]:
                p.send_multipart(encode_message(b"", seqs[w], encode_payload(ev, ts=time.time())))
                seqs[w] += 1
                sent += 1
        wait(lambda: sum(messages()) >= sum(seqs), 120, "the event stream to be applied")
        ingest_s = time.perf_counter() - t0
        rng = random.Random(1)
        bodies = [
            json.dumps({"token_ids": docs[rng.randrange(len(docs))][:4096]}).encode()
            for _ in range(256)
        ]
        status, data, _ = c.call("POST", "/route", bodies[0])
        assert status == 200, data
        assert json.loads(data)["request_blocks"] == 256
        for i in range(300):  # warm up
            c.call("POST", "/route", bodies[i % len(bodies)])
        text = c.call("GET", "/metrics")[1].decode()
        before = _histogram_sum_count(text, "kvrouter_route_latency_seconds")
        per_round = []
        for _ in range(rounds):
            per_round.append(
                [c.call("POST", "/route", bodies[i % len(bodies)])[2] for i in range(queries)]
            )
        after = _histogram_sum_count(
            c.call("GET", "/metrics")[1].decode(), "kvrouter_route_latency_seconds"
        )
        server_mean = (after[0] - before[0]) / max(1.0, after[1] - before[1])
        lat = [x for r in per_round for x in r]
        return {
            "server_mean": server_mean,
            "rounds": [(pct(r, 0.5), pct(r, 0.99)) for r in per_round],  # type: ignore[dict-item]
            "mean": sum(lat) / len(lat),
            "ingest_msgs": float(sent),
            "ingest_s": ingest_s,
            "samples": lat,  # type: ignore[dict-item]
        }
    finally:
        router.terminate()
        router.wait(30)
        for p in pubs:
            p.close(0)
        ctx.term()


# --------------------------------------------------------------------------- proxy


def bench_proxy(
    seconds: float, rate: float, rounds: int, worker_url: str
) -> list[dict[str, list[float]]]:
    router, url = spawn(
        [sys.executable, "-m", "router", "--port", "0", "--log-level", "warning",
         "--worker", f"id=w0,url={worker_url},events=tcp://127.0.0.1:1"]
    , r"listening on (http://\S+)")  # fmt: skip
    try:
        direct, routed = Client(worker_url), Client(url)
        prompt = "".join(random.Random(2).choice("abcdefgh ") for _ in range(1000))
        body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 1}).encode()
        for _ in range(200):  # warm up both paths (connections, code paths)
            assert direct.call("POST", "/v1/completions", body)[0] == 200
            s, data, _ = routed.call("POST", "/v1/completions", body)
            assert s == 200, data
        outs = []
        for _ in range(rounds):
            out: dict[str, list[float]] = {"direct": [], "router": []}
            n = int(seconds * rate)
            t0 = time.perf_counter()
            for i in range(n):
                due = t0 + i / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                if i % 2 == 0:
                    out["direct"].append(direct.call("POST", "/v1/completions", body)[2])
                else:
                    out["router"].append(routed.call("POST", "/v1/completions", body)[2])
            outs.append(out)
        return outs
    finally:
        router.terminate()
        router.wait(30)


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", choices=["route", "proxy"])
    ap.add_argument("--queries", type=int, default=5000, help="/route requests measured")
    ap.add_argument("--seconds", type=float, default=10.0, help="proxy time per round")
    ap.add_argument("--rate", type=float, default=100.0, help="proxy requests per second")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (median reported)")
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "out" / "bench_route.png"))
    ap.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_worker:
        serve_worker()
        return
    worker, worker_url = spawn(
        [sys.executable, str(Path(__file__).resolve()), "--serve-worker"], r"worker (http://\S+)"
    )
    rows = []
    route = None
    proxy: list[dict[str, list[float]]] | None = None
    try:
        if args.only in (None, "route"):
            route = bench_route(args.queries, args.rounds, worker_url)
            rows.append(("/route 4,096 tok x 8 workers", route["rounds"], "p99 <= 438 us"))
        if args.only in (None, "proxy"):
            proxy = bench_proxy(args.seconds, args.rate, args.rounds, worker_url)
            d = [(pct(r["direct"], 0.5), pct(r["direct"], 0.99)) for r in proxy]
            v = [(pct(r["router"], 0.5), pct(r["router"], 0.99)) for r in proxy]
            rows.append(("completions direct", d, ""))
            rows.append(("completions via router", v, ""))
            added = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(d, v)]
            rows.append(("  added by the router", added, "p99 <= 2 ms"))
    finally:
        worker.terminate()
        worker.wait(30)
    # each round's p50/p99, and the median round: the machine's noise moves single rounds
    print(f"\n{'measure':<32}{'p50':>10}{'p99':>10}   {'target':<16}per round p50/p99 (us)")
    for name, per, target in rows:
        p50 = statistics.median(x[0] for x in per)
        p99 = statistics.median(x[1] for x in per)
        each = "  ".join(f"{a * 1e6:.0f}/{b * 1e6:.0f}" for a, b in per)
        print(f"{name:<32}{p50 * 1e6:>8.0f}us{p99 * 1e6:>8.0f}us   {target:<16}{each}")
    if route is not None:
        print(
            f"\n(ingest: {int(route['ingest_msgs'])} messages applied in {route['ingest_s']:.2f} s; "
            f"/route mean {route['mean'] * 1e6:.0f} us over {args.queries * args.rounds} requests, of which "
            f"{route['server_mean'] * 1e6:.0f} us in the handler after the body was read)"
        )
    _plot(args.plot, route, proxy)


def _plot(path: str, route, proxy) -> None:  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    series = []
    if route is not None:
        series.append(("/route", route["samples"]))
    if proxy is not None:
        direct = [x for r in proxy for x in r["direct"]]
        routed = [x for r in proxy for x in r["router"]]
        series += [("completions direct", direct), ("via router", routed)]
    if not series:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, xs in series:
        s = sorted(x * 1e6 for x in xs)
        ax.plot(s, [i / len(s) for i in range(len(s))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("latency (us)")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    ax.grid(True, alpha=0.3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
