"""Event-plane benchmark: end-to-end ingest, `match` latency, and index memory.

Run (about two minutes on the 2-core dev machine):

    python benchmarks/bench_ingest.py                 # everything
    python benchmarks/bench_ingest.py --only ingest   # or: match, memory
    python benchmarks/bench_ingest.py --publishers 2 --messages 40000 --per-message 1 4
    python benchmarks/bench_ingest.py --only paced --rate 50 --seconds 20   # as engines publish

1. ingest: N publisher processes each PUB a pre-encoded stream over ZMQ (vLLM >= 0.24 format,
   16-token blocks, 16 blocks per BlockStored, chains of 64 stores from the root, and one
   BlockRemoved of 16 old blocks per store once a window is full, so the index stays bounded;
   1 or more stores per message, as a vLLM step batches the events of all its requests);
   the real `Subscriber` applies it to a `PrefixIndex`. Reported: stored blocks/s from the first to
   the last applied message, summed over publishers. Reference (issue 2): Dynamo's standalone
   indexer applies about 0.96 M blocks/s end to end on this machine with the same stream shape.
1b. paced: the same stream as engines publish it live, one step's events at a time: 8
   publishers, each ``--rate`` messages a second at exponential intervals (one 16-block store
   and, once the window is full, one removal per message). Reported: this process's CPU per
   message (all its threads: the subscriber task, the event loop, libzmq's I/O thread), in turn
   for the real ``Subscriber`` with the router's read window (``subscriber.batch_window_ms``)
   and without one, and for a bare reader of the same publishers (each SUB's ZMQ_FD on the
   loop, every message received and dropped: no task, no decode, no index). Without a window,
   at a live rate every message is one wake-up of an idle loop, and a wake-up costs more than
   the message: the bare reader is the floor of reading each message as it comes; the window
   reads a busy fleet once per window instead.
2. match: p50/p99 of `request_hashes` + `match` (hashing included, tokenization not) for 512,
   4,096 and 32,768-token requests against 8, 64 and 512 workers holding random-length prefixes of
   shared documents (system prompts shared by groups of documents).
3. memory: bytes per (block, worker) entry at about 1 M entries, by tracemalloc: with shared
   prefixes (64 workers) and with nothing shared (8 workers, every block on one worker).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from indexer.events import BlockRemoved, BlockStored
from indexer.index import PrefixIndex
from router.settings.config import SubscriberSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from index_workloads import bench_match, bench_memory

BS = 16
BLOCKS_PER_EVENT = 16
CHAIN_MESSAGES = 64
WINDOW_MESSAGES = 256
_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


# --------------------------------------------------------------------------- ingest


def _publisher(conn, messages: int, seed: int, per_message: int, rate: float = 0.0) -> None:
    """(a child process) ``rate`` > 0: that many messages a second, at exponential intervals."""
    import zmq

    from indexer.wire import encode_message, encode_payload

    rng = random.Random(seed)
    base = seed << 40
    payloads = []
    parent = None
    events: list = []
    for k in range(messages * per_message):
        # store k: a 16-block BlockStored; chains of CHAIN_MESSAGES stores from the root
        first = base + k * BLOCKS_PER_EVENT
        hashes = [(x * _GOLDEN) & _M64 for x in range(first, first + BLOCKS_PER_EVENT)]
        tokens = [rng.randrange(50_000) for _ in range(BS * BLOCKS_PER_EVENT)]
        if k % CHAIN_MESSAGES == 0:
            parent = None
        events.append(BlockStored(hashes, parent, tokens, BS, "GPU", "GPU"))
        parent = hashes[-1]
        if k >= WINDOW_MESSAGES:
            old = base + (k - WINDOW_MESSAGES) * BLOCKS_PER_EVENT
            gone = [(x * _GOLDEN) & _M64 for x in range(old, old + BLOCKS_PER_EVENT)]
            events.append(BlockRemoved(gone, "GPU", "GPU"))
        if len(events) >= 2 * per_message or (k < WINDOW_MESSAGES and len(events) >= per_message):
            payloads.append(encode_payload(events, ts=time.time(), dp_rank=0))
            events = []
    if events:
        payloads.append(encode_payload(events, ts=time.time(), dp_rank=0))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:*")
    conn.send(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    # probe messages until the parent says the subscriber sees us (slow-joiner safe)
    probe = encode_payload([], ts=time.time(), dp_rank=0)
    seq = 0
    while not conn.poll(0.01):
        pub.send_multipart(encode_message(b"kv-events", seq, probe))
        seq += 1
    conn.recv()
    conn.send(seq)
    due = time.perf_counter()
    for p in payloads:
        if rate > 0:  # paced as an engine publishes: one step's events at a time
            due += rng.expovariate(rate)
            time.sleep(max(0.0, due - time.perf_counter()))
        pub.send_multipart(encode_message(b"kv-events", seq, p), copy=False)
        seq += 1
    conn.recv()  # stay alive until the parent is done
    pub.close(linger=0)
    ctx.term()


def _spawn(
    publishers: int, messages: int, per_message: int, rate: float
) -> tuple[list, list, list]:
    """The publisher processes: their pipes, processes and endpoints."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for i in range(publishers):
        a, b = ctx.Pipe()
        p = ctx.Process(
            target=_publisher, args=(b, messages, i + 1, per_message, rate), daemon=True
        )
        p.start()
        pipes.append(a)
        procs.append(p)
    return pipes, procs, [a.recv() for a in pipes]


def _go(pipes: list) -> list:
    """Start the publishers' streams; their first stream seqs. (A blocking receive on the loop's
    thread: nothing is read until the caller has taken its baseline.)"""
    for a in pipes:
        a.send("go")
    return [a.recv() for a in pipes]


def _bye(pipes: list, procs: list) -> None:
    for a in pipes:
        a.send("bye")
    for p in procs:
        p.join(5)


async def _bare_reader(publishers: int, messages: int, rate: float) -> dict:
    """The floor of paced ingest: the same publishers read by a bare event-loop reader (each
    SUB's ZMQ_FD registered with the loop, every waiting message received and dropped), no
    decode, no index, no task of its own. What is left is the loop's and libzmq's cost of one
    wake-up per message."""
    import zmq

    pipes, procs, endpoints = _spawn(publishers, messages, 1, rate)
    ctx = zmq.Context()
    socks = []
    for ep in endpoints:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(ep)
        socks.append(s)
    got = [0] * publishers
    loop = asyncio.get_running_loop()

    def on_fd(i: int) -> None:
        s = socks[i]
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            s.recv_multipart(zmq.NOBLOCK)
            got[i] += 1

    for i, s in enumerate(socks):
        loop.add_reader(s.getsockopt(zmq.FD), on_fd, i)
    while not all(got):
        await asyncio.sleep(0.005)  # benchmark pacing only: the probes to arrive
    starts = _go(pipes)
    base = list(got)
    cpu0 = time.process_time()
    deadline = time.monotonic() + 600
    while sum(got) - sum(base) < publishers * messages and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    cpu = time.process_time() - cpu0
    for s in socks:
        loop.remove_reader(s.getsockopt(zmq.FD))
        s.close(0)
    ctx.term()
    _bye(pipes, procs)
    return {"applied": sum(got) - sum(base), "cpu_s": cpu, "start_seqs": starts}


async def _paced_subscriber(messages: int, rate: float, batch_window: float) -> dict:
    """Paced ingest by the real ``Subscriber``: 8 publishers, one store per message."""
    return (await _ingest(8, messages, 1, rate, batch_window))[2]


async def _ingest(
    publishers: int,
    messages: int,
    per_message: int = 1,
    rate: float = 0.0,
    batch_window: float = 0.0,
) -> tuple[float, int, dict]:
    from indexer.subscriber import Subscriber, WorkerEndpoint

    pipes, procs, endpoints = _spawn(publishers, messages, per_message, rate)
    index = PrefixIndex(BS)
    sub = Subscriber(index, batch_window=batch_window)
    await sub.start()
    for i, ep in enumerate(endpoints):
        await sub.add_worker(WorkerEndpoint(f"pub{i}", ep))
    keys = [(f"pub{i}", 0) for i in range(publishers)]
    while not all(k in sub.stats() and sub.stats()[k].messages > 0 for k in keys):
        await asyncio.sleep(0.005)  # benchmark pacing only: waiting for probes to arrive
    starts = _go(pipes)
    base = {k: sub.stats()[k].messages for k in keys}
    t0 = None
    cpu0 = time.process_time()
    total = publishers * messages
    deadline = time.monotonic() + 600
    while True:
        st = sub.stats()
        done = sum(st[k].messages - base[k] for k in keys)
        if t0 is None and done > 0:
            t0 = time.perf_counter()
        if done >= total or time.monotonic() > deadline:
            break
        # paced: polled rarely, so the poll's own CPU stays out of the per-message figure
        await asyncio.sleep(0.25 if rate > 0 else 0.002)
    elapsed = time.perf_counter() - (t0 or time.perf_counter())
    cpu = time.process_time() - cpu0
    st = sub.stats()
    info = {
        "gaps": sum(st[k].gaps for k in keys),
        "malformed": sum(st[k].malformed for k in keys),
        "entries": index.entries(),
        "applied": sum(st[k].messages - base[k] for k in keys),
        "start_seqs": starts,
        "cpu_s": cpu,
    }
    await sub.aclose()
    _bye(pipes, procs)
    return elapsed, done * per_message * BLOCKS_PER_EVENT, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["ingest", "paced", "match", "memory"])
    ap.add_argument("--publishers", type=int, default=2)
    ap.add_argument("--messages", type=int, default=30_000, help="messages per publisher")
    ap.add_argument("--rounds", type=int, default=3000, help="match calls per row")
    ap.add_argument("--repeat", type=int, default=3, help="ingest runs; the median is reported")
    ap.add_argument(
        "--per-message",
        type=int,
        nargs="+",
        default=[1, 4],
        help="BlockStored events per ZMQ message (each with its BlockRemoved once the window is full)",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=50.0,
        help="paced: messages per second per publisher (8 publishers, --seconds long)",
    )
    ap.add_argument("--seconds", type=float, default=20.0, help="paced: how long")
    args = ap.parse_args()

    if args.only in (None, "ingest"):
        print("\n## ingest (ZMQ publishers in other processes -> Subscriber -> PrefixIndex)\n")
        print("| publishers | stores per message | stored blocks | seconds | blocks/s | gaps |")
        print("|---|---|---|---|---|---|")
        for per in args.per_message:
            runs = []
            for _ in range(args.repeat):
                elapsed, blocks, info = asyncio.run(_ingest(args.publishers, args.messages, per))
                runs.append((blocks / elapsed, elapsed, blocks, info))
            for r, el, bl, info in runs:
                print(
                    f"| {args.publishers} | {per} | {bl:,} | {el:.2f} | {r:,.0f} | {info['gaps']} |"
                )
            rate = statistics.median(r[0] for r in runs)
            print(f"| | {per} | median | | **{rate:,.0f}** | |")
        print("\ntarget >= 500,000 blocks/s; Dynamo's indexer reference ~960,000 on this machine")

    if args.only in (None, "paced"):
        import uvloop

        n = max(1, int(args.rate * args.seconds))
        print(f"\n## paced ingest (8 publishers x {args.rate:g} messages/s, 1 store each)\n")
        print("| run | reader | messages | CPU s | CPU µs per message |")
        print("|---|---|---|---|---|")
        window = SubscriberSettings().batch_window_ms
        batched, unbatched = f"Subscriber, {window:g} ms window", "Subscriber, no window"
        per_msg: dict[str, list[float]] = {batched: [], unbatched: [], "bare": []}
        for i in range(args.repeat):  # the readers in turn, so all see the same noise
            for name, coro in (
                (batched, lambda: _paced_subscriber(n, args.rate, window / 1000)),
                (unbatched, lambda: _paced_subscriber(n, args.rate, 0.0)),
                ("bare", lambda: _bare_reader(8, n, args.rate)),
            ):
                info = uvloop.run(coro())  # the router's loop
                us = info["cpu_s"] / max(1, info["applied"]) * 1e6
                per_msg[name].append(us)
                print(
                    f"| {i + 1} | {name} | {info['applied']:,} | {info['cpu_s']:.2f} | {us:.1f} |"
                )
        for name, xs in per_msg.items():
            print(f"| median | {name} | | | **{statistics.median(xs):.1f}** |")
        print(
            "\n(this process's CPU, all its threads: the reader, the event loop, libzmq's I/O"
            " thread; bare: the same messages received and dropped by a loop callback)"
        )

    if args.only in (None, "match"):
        rows = bench_match(args.rounds)
        print("\n## match latency (request_hashes + match)\n")
        print("| tokens | workers | index entries | p50 µs | p99 µs |")
        print("|---|---|---|---|---|")
        for ntok, w, e, p50, p99 in rows:
            print(f"| {ntok:,} | {w} | {e:,} | {p50:.1f} | {p99:.1f} |")
        print("\ntarget: p99 <= 100 µs at 4,096 tokens x 64 workers")

    if args.only in (None, "memory"):
        print("\n## memory (tracemalloc)\n")
        print(
            "| index | (block, worker) entries | distinct router blocks | bytes/entry (heap) |"
            " bytes/entry (RSS) |"
        )
        print("|---|---|---|---|---|")
        for label, entries, blocks, per, rss in bench_memory():
            r = f"{rss:.0f}" if rss is not None else "n/a (inputs share the heap)"
            print(f"| {label} | {entries:,} | {blocks:,} | {per:.0f} | {r} |")
        print("\ntarget: <= 200 bytes per entry")


if __name__ == "__main__":
    main()
