"""Side by side: our router's ``POST /route`` against NVIDIA Dynamo's standalone KV indexer's
``POST /query``, on the same index state and the same queries, in one run.

Run (nothing else should be running; about 20 seconds on the 2-core dev machine):

    python benchmarks/bench_vs_dynamo.py                      # 3 rounds x 5,000 requests per server
    python benchmarks/bench_vs_dynamo.py --queries 300 --rounds 1          # a quick check
    python benchmarks/bench_vs_dynamo.py --dynamo-threads 1   # Dynamo's single-threaded KvIndexer
    taskset -c 0 python benchmarks/bench_vs_dynamo.py         # every process on one core
    python benchmarks/bench_vs_dynamo.py --floors  # and uvicorn alone (h11, httptools): a fixed answer

Dynamo is never a dependency of this repository: it lives in its own virtual environment (the
wheel is ~275 MB), given by ``--dynamo-python`` (default ``/tmp/dyn/bin/python``). Create it with

    python -m venv /tmp/dyn && /tmp/dyn/bin/pip install ai-dynamo-runtime==1.6.1

What runs, all on one machine: the router (``python -m router``, as ``bench_route.py`` starts it,
with its minimal worker ``bench_route.py --serve-worker`` so health checks pass), Dynamo's indexer
(``python -m dynamo.indexer --block-size 16 --workers "0=tcp://...,...,7=tcp://..."``; it takes
no bind address and listens on 0.0.0.0, the only thing here not on 127.0.0.1), and 8 ZMQ PUB
sockets in this process that both subscribe to, so one publication of the stream feeds both.

The state is ``bench_route.py``'s (``build_stream``): 8 workers each announce 16 random-length
prefixes of 64 shared documents (4 shared 1,024-token system prompts) as chained ``BlockStored``
events, vLLM >= 0.24 wire format, 16-token blocks. One change: the block hashes are re-derived from
the content (a hash of the parent hash and the block's tokens), as vLLM computes them with a fixed
``PYTHONHASHSEED`` (which Dynamo's docs require), instead of ``build_stream``'s serial numbers that
give the same tokens a new hash every time they are stored. Dynamo 1.6.1's radix tree keeps the
first hash it saw for a block's content and drops any later store whose parent is the other hash
(``ParentBlockNotFound``, most of the stream); our index keys by content and takes either. With
``--raw-hashes`` the serial numbers are published as they are, and the check below fails.

Steps:

1. join: per worker, a one-block sentinel store is published until the router's subscriber has
   seen a message from every worker and Dynamo's ``/query`` shows every worker's sentinel (ZMQ
   slow joiners drop what a PUB sends before the subscription has arrived).
2. the stream, then per worker a second one-block sentinel; applied when the router's
   ``last_seq`` (``GET /workers``) is every worker's last sequence number and Dynamo's ``/query``
   shows every worker's end sentinel (each worker's events are applied in order by both).
3. check: for every document queried, Dynamo's per-worker score (matched tokens / 16) must equal
   the router's ``matched_blocks`` per candidate, else it is no like-for-like comparison and the
   run stops with exit status 1.
4. 300 warm-up requests per server, then ``--rounds`` rounds of ``--queries`` requests per server,
   each server over one keep-alive connection (``bench_route.Client``); the requests are
   interleaved one by one (the same document to each, back to back, the order rotated every
   request) so all see the same machine noise. With ``--floors``, two more servers take part:
   ``bench_http_floor.py --serve-asgi h11|httptools``, a bare ASGI app on uvicorn with the
   router's server settings that reads the ``/route`` body and sends a fixed answer of the same
   size, i.e. what the maintained server alone costs. Bodies: ``{"token_ids": doc[:4096]}`` for
   ``/route`` and ``{"token_ids": doc[:4096], "model_name": "default"}`` for ``/query`` (256
   blocks), the documents drawn by ``random.Random(1)`` as in ``bench_route.py``. Latency:
   client-side, from the request write to the last response byte. With ``--floors`` the table
   also splits "router - floor": the answer itself (the router's mean time from the body read
   to the encoded answer, from its ``/metrics``: decoding, hashing, matching, ranking,
   encoding); the rest is its HTTP layers (request id, dispatch, body read, send).

The table gives each server's p50/p99 as the median over rounds with every round's beside it, and
router/Dynamo ratios per round and their median. On the 2-vCPU dev VM identical runs differ by
1.5-2x: only same-run comparisons and ratios mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: indexer
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_route, bench_ingest

from bench_route import WORKERS, Client, build_stream, pct, spawn, wait
from dynamo_peer import (
    BS,
    MODEL,
    content_addressed,
    dynamo_scores,
    dynamo_stored,
    dynamo_version,
    sentinel,
    start_dynamo,
    stop,
)

from indexer.events import BlockStored

HERE = Path(__file__).resolve().parent

QUERY_TOKENS = 4096
WARMUP = 300
JOIN_TOKEN = 60_000  # sentinel token ids: above every document token (< 50,000)
END_TOKEN = 61_000


# --------------------------------------------------------------------------- router


def router_ranks(c: Client) -> list[dict[str, Any]]:
    ws = json.loads(c.call("GET", "/workers")[1])["workers"]
    by_id = {w["id"]: w["ranks"][0]["subscriber"] for w in ws}
    return [by_id[f"w{w}"] for w in range(WORKERS)]


def router_matched(c: Client, body: bytes) -> dict[int, int]:
    status, data, _ = c.call("POST", "/route", body)
    if status != 200:
        raise SystemExit(f"router /route answered {status}: {data[:300]!r}")
    out = json.loads(data)
    assert out["request_blocks"] == QUERY_TOKENS // BS, out["request_blocks"]
    return {int(cand["worker_id"][1:]): cand["matched_blocks"] for cand in out["candidates"]}


# --------------------------------------------------------------------------- benchmark


def route_answer_mean(c: Client) -> float | None:
    """The router's own mean time to answer a ``/route`` once its body is read (placement and
    the answer's encoding: ``kvrouter_route_latency_seconds``, over every request it served)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = c.call("GET", "/metrics")[1].decode()
    got = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvrouter_route_latency_seconds"
        for sample in family.samples
    }
    count = got.get("kvrouter_route_latency_seconds_count")
    return got["kvrouter_route_latency_seconds_sum"] / count if count else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark; Dynamo's log is kept (and named) only when it fails."""
    with tempfile.NamedTemporaryFile(prefix="dynamo-indexer-", suffix=".log", delete=False) as log:
        try:
            res = _bench(args, log)
        except BaseException:
            print(f"(Dynamo's log: {log.name})", file=sys.stderr)
            raise
    Path(log.name).unlink()
    return res


def _bench(args: argparse.Namespace, log: IO[bytes]) -> dict[str, Any]:
    import zmq

    from indexer.wire import encode_message, encode_payload

    if not Path(args.dynamo_python).exists():
        raise SystemExit(
            f"{args.dynamo_python} not found; create Dynamo's venv with\n"
            "  python -m venv /tmp/dyn && /tmp/dyn/bin/pip install ai-dynamo-runtime==1.6.1"
        )
    streams, docs = build_stream()
    if not args.raw_hashes:
        streams = content_addressed(streams)
    ts = time.time()
    payloads = [[encode_payload(b, ts=ts) for b in s] for s in streams]
    joins = [sentinel(JOIN_TOKEN + w) for w in range(WORKERS)]
    ends = [sentinel(END_TOKEN + w) for w in range(WORKERS)]
    rng = random.Random(1)
    picks = [rng.randrange(len(docs)) for _ in range(256)]
    r_bodies = [json.dumps({"token_ids": docs[d][:QUERY_TOKENS]}).encode() for d in picks]
    d_bodies = [
        json.dumps({"token_ids": docs[d][:QUERY_TOKENS], "model_name": MODEL}).encode()
        for d in picks
    ]

    ctx = zmq.Context()
    pubs = []
    procs: list[subprocess.Popen[Any]] = []
    clients: list[Client] = []
    try:
        for _ in range(WORKERS):
            p = ctx.socket(zmq.PUB)
            p.setsockopt(zmq.SNDHWM, 0)
            p.bind("tcp://127.0.0.1:*")
            pubs.append(p)
        eps = [p.getsockopt_string(zmq.LAST_ENDPOINT) for p in pubs]
        worker, worker_url = spawn(
            [sys.executable, str(HERE / "bench_route.py"), "--serve-worker"], r"worker (http://\S+)"
        )
        procs.append(worker)
        specs = []
        for w, ep in enumerate(eps):
            specs += ["--worker", f"id=w{w},url={worker_url},events={ep}"]
        router, router_url = spawn(
            [sys.executable, "-m", "router", "--port", "0", "--log-level", "warning", *specs],
            r"listening on (http://\S+)",
        )
        procs.append(router)
        spec = ",".join(f"{w}={ep}" for w, ep in enumerate(eps))
        dynamo, dynamo_url = start_dynamo(args.dynamo_python, spec, args.dynamo_threads, log)
        procs.append(dynamo)
        rc, dc = Client(router_url), Client(dynamo_url)
        clients += [rc, dc]
        seqs = [0] * WORKERS

        def publish(w: int, payload: bytes) -> None:
            pubs[w].send_multipart(encode_message(b"", seqs[w], payload))
            seqs[w] += 1

        def dynamo_sees(marks: list[tuple[BlockStored, list[int]]]) -> bool:
            return all(dynamo_scores(dc, toks).get(w, 0) >= 1 for w, (_, toks) in enumerate(marks))

        # 1. slow joiners: the join sentinel until every subscriber of both has seen one
        join_payloads = [encode_payload([ev], ts=ts) for ev, _ in joins]
        deadline = time.monotonic() + 60
        while not (min(s["messages"] for s in router_ranks(rc)) > 0 and dynamo_sees(joins)):
            if time.monotonic() > deadline:
                raise SystemExit("the subscribers never received the join sentinels")
            for w in range(WORKERS):
                publish(w, join_payloads[w])
            time.sleep(0.02)
        before = dynamo_stored(dc)

        # 2. the stream once, then the end sentinels; both apply each worker's events in order
        t0 = time.perf_counter()
        for w in range(WORKERS):
            for payload in payloads[w]:
                publish(w, payload)
            publish(w, encode_payload([ends[w][0]], ts=ts))
        done: dict[str, float] = {}

        def applied() -> bool:
            if "router" not in done and all(
                s["last_seq"] == seqs[w] - 1 for w, s in enumerate(router_ranks(rc))
            ):
                done["router"] = time.perf_counter() - t0
            if "dynamo" not in done and dynamo_sees(ends):
                done["dynamo"] = time.perf_counter() - t0
            return len(done) == 2

        wait(applied, 120, "the event stream to be applied by both")
        after = dynamo_stored(dc)
        stored = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        orphans = sum(s.get("orphans", 0) for s in router_ranks(rc))

        # 3. the same question: per-worker overlap in blocks, for every document queried
        mismatches = []
        nonzero = past_prompt = 0
        for d in sorted(set(picks)):
            body = json.dumps({"token_ids": docs[d][:QUERY_TOKENS]}).encode()
            ours = router_matched(rc, body)
            theirs = dynamo_scores(dc, docs[d][:QUERY_TOKENS])
            for w in range(WORKERS):
                a, b = ours.get(w, 0), theirs.get(w, 0)
                nonzero += a > 0
                past_prompt += a > 1024 // BS  # beyond the shared system prompt
                if a != b:
                    mismatches.append((d, w, a, b))
        if mismatches:
            lines = "\n".join(
                f"  doc {d:2d} worker {w}: router {a:3d} blocks, Dynamo {b:3d}"
                for d, w, a, b in mismatches[:12]
            )
            bad = {k: v for k, v in stored.items() if k != "ok" and v}
            raise SystemExit(
                f"not like for like: {len(mismatches)} (document, worker) overlaps differ\n"
                f"{lines}\nDynamo's stores by outcome: ok {stored.get('ok', 0)}, others {bad}"
            )
        if nonzero == 0:
            raise SystemExit("every overlap is 0: the stream was not applied")

        # 4. warm up, then the interleaved rounds: one request to each server in turn, the
        # order rotated every request so that none always follows the same other
        targets = [(rc, "/route", r_bodies), (dc, "/query", d_bodies)]
        for http in ("h11", "httptools") if args.floors else ():
            floor, floor_url = spawn(
                [sys.executable, str(HERE / "bench_http_floor.py"), "--serve-asgi", http],
                r"floor (http://\S+)",
            )
            procs.append(floor)
            clients.append(Client(floor_url))
            targets.append((clients[-1], "/route", r_bodies))

        def measure(n: int) -> list[list[float]]:
            lat: list[list[float]] = [[] for _ in targets]
            m = len(targets)
            for i in range(n):
                k = i % len(r_bodies)
                for j in range(m):
                    t = (i + j) % m
                    c, path, bodies = targets[t]
                    status, body, took = c.call("POST", path, bodies[k])
                    if status != 200:
                        raise SystemExit(f"{path} answered {status}: {body[:200]!r}")
                    lat[t].append(took)
            return lat

        measure(WARMUP)
        rounds = [measure(args.queries) for _ in range(args.rounds)]
        answer = route_answer_mean(rc)
        return {
            "answer": answer,
            "rounds": rounds,
            "done": done,
            "stored": stored,
            "events": sum(len(s) for s in streams),
            "orphans": orphans,
            "docs": len(set(picks)),
            "nonzero": nonzero,
            "past_prompt": past_prompt,
        }
    finally:
        for c in clients:
            c.sock.close()
        for proc in reversed(procs):
            stop(proc)
        for p in pubs:
            p.close(0)
        ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--queries", type=int, default=5000, help="requests per server per round")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (median reported)")
    ap.add_argument("--dynamo-python", default="/tmp/dyn/bin/python", help="Dynamo's venv python")
    ap.add_argument("--dynamo-threads", type=int, help="Dynamo's --threads (default: its own, 4)")
    ap.add_argument(
        "--raw-hashes", action="store_true", help="build_stream's serial block hashes, as they are"
    )
    ap.add_argument(
        "--floors",
        action="store_true",
        help="also a bare ASGI app with a fixed answer on uvicorn (h11, httptools): the server alone",
    )
    args = ap.parse_args()
    version = dynamo_version(args.dynamo_python)
    res = run(args)
    us = 1e6
    names = ["router  POST /route", "Dynamo  POST /query"]
    short = ["router", "Dynamo"]
    if args.floors:
        names += ["uvicorn h11, fixed answer", "uvicorn httptools, fixed"]
        short += ["uvicorn h11", "uvicorn httptools"]
    per = {
        n: [(pct(r[t], 0.5), pct(r[t], 0.99)) for r in res["rounds"]] for t, n in enumerate(names)
    }
    threads = args.dynamo_threads if args.dynamo_threads is not None else "4 (default)"
    stored = res["stored"]
    others = {k: v for k, v in stored.items() if k != "ok" and v}
    print(
        f"\nstate: {res['events']} BlockStored messages; applied by the router in "
        f"{res['done']['router']:.2f} s ({res['orphans']} orphan stores), by Dynamo in "
        f"{res['done']['dynamo']:.2f} s (stores ok {stored.get('ok', 0)}, other outcomes "
        f"{others or 'none'})"
    )
    print(
        f"check: {res['docs']} documents x {WORKERS} workers, per-worker overlap equal "
        f"({res['nonzero']} non-zero, {res['past_prompt']} past the 64-block shared prompt)"
    )
    print(
        f"Dynamo: ai-dynamo-runtime {version}, --threads {threads}; {args.rounds} rounds x "
        f"{args.queries} requests per server, interleaved one by one\n"
    )
    print(f"{'server':<28}{'p50':>10}{'p99':>10}   per round p50/p99 (us)")
    for name, xs in per.items():
        p50 = statistics.median(x[0] for x in xs)
        p99 = statistics.median(x[1] for x in xs)
        each = "  ".join(f"{a * us:.0f}/{b * us:.0f}" for a, b in xs)
        print(f"{name:<28}{p50 * us:>8.0f}us{p99 * us:>8.0f}us   {each}")
    dynamo = per[names[1]]
    for t in (0, *range(2, len(names))):
        ratios = [(a[0] / b[0], a[1] / b[1]) for a, b in zip(per[names[t]], dynamo)]
        r50 = statistics.median(x[0] for x in ratios)
        r99 = statistics.median(x[1] for x in ratios)
        each = "  ".join(f"{a:.2f}/{b:.2f}" for a, b in ratios)
        print(f"{short[t] + ' / Dynamo':<28}{r50:>10.2f}{r99:>10.2f}   {each}")
    if args.floors:  # the router's own cost: above the floor of the parser it runs on
        http = os.environ.get("KVROUTER_SERVER__HTTP", "h11")
        floor = per[names[2] if http == "h11" else names[3]]
        over = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(per[names[0]], floor)]
        o50 = statistics.median(x[0] for x in over)
        o99 = statistics.median(x[1] for x in over)
        each = "  ".join(f"{a * us:.0f}/{b * us:.0f}" for a, b in over)
        label = f"router - {http} floor"
        print(f"{label:<28}{o50 * us:>8.0f}us{o99 * us:>8.0f}us   {each}")
        if res["answer"] is not None:  # what of that is the answer itself, what the HTTP layers
            label = "  of which: the answer"
            print(
                f"{label:<28}{res['answer'] * us:>8.0f}us{'':>10}   (mean, the router's /metrics)"
            )
    print(
        "(each column: the median over rounds; ratios per round, the same round's noise for both)"
    )


if __name__ == "__main__":
    main()
