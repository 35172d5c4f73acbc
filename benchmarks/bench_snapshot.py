"""The event loop's longest stall while the router snapshots its index: encoded in one step on
the loop (as before) against a rank at a time with the encoding in a thread
(:func:`router.runtime.service.snapshot_off_loop`, what periodic snapshots and a peer's
``/admin/snapshot`` use).

Run (in-process, no sockets; about 30 s on the 2-core dev machine at the default size):

    python benchmarks/bench_snapshot.py                      # 8 ranks x 125,000 entries
    python benchmarks/bench_snapshot.py --ranks 1 --entries 1000000   # one rank holds it all

The index is filled with chained ``BlockStored`` events of 100 random 16-token blocks per
prompt. A ticker task wakes every millisecond and records how late each wake-up is; the table
gives each way's wall time, the longest and the 99th-percentile lateness over ``--repeat``
snapshots, and checks that both ways give the same bytes (they must: one builder).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from indexer.events import BlockStored  # noqa: E402
from indexer.index import PrefixIndex  # noqa: E402
from router.runtime.service import snapshot_off_loop  # noqa: E402


def build(ranks: int, entries: int, seed: int = 0) -> PrefixIndex:
    rng = random.Random(seed)
    index = PrefixIndex(16)
    for r in range(ranks):
        index.add_worker(f"w{r}")
        parent = None
        for _ in range(entries // 100):
            hashes = [rng.getrandbits(63) for _ in range(100)]
            tokens = [rng.randrange(50_000) for _ in range(1600)]
            index.apply_event((f"w{r}", 0), BlockStored(hashes, parent, tokens, 16))
            parent = hashes[-1]
    return index


async def stalls(
    take: Callable[[], Awaitable[bytes]], repeat: int
) -> tuple[list[float], float, bytes]:
    """(every wake-up's lateness in s, mean wall time of a snapshot, the last snapshot)."""
    late: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - t - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    late.clear()
    data = b""
    wall = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        data = await take()
        wall += (time.perf_counter() - t0) / repeat
        await asyncio.sleep(0.02)  # (the ticker's turn: one stall per snapshot)
    done = True
    await task
    return late, wall, data


async def main_async(args: argparse.Namespace) -> int:
    t = time.perf_counter()
    index = build(args.ranks, args.entries)
    print(
        f"index: {index.entries():,} entries in {args.ranks} ranks ({time.perf_counter() - t:.0f} s to build)"
    )
    seqs = {key: 7 for key in index.workers()}

    async def on_loop() -> bytes:
        return index.snapshot_bytes(seqs)

    async def off_loop() -> bytes:
        return await snapshot_off_loop(index, seqs.get)

    rows = []
    out = {}
    for name, take in (("on the loop, one step", on_loop), ("a rank at a time + thread", off_loop)):
        late, wall, out[name] = await stalls(take, args.repeat)
        late.sort()
        p99 = late[int(0.99 * (len(late) - 1))]
        rows.append((name, wall, max(late), p99, statistics.median(late)))
    same = len(set(out.values())) == 1
    print(f"\n{'snapshot':28s} {'wall ms':>8s} {'max stall ms':>13s} {'p99 ms':>7s} {'p50 ms':>7s}")
    for name, wall, worst, p99, p50 in rows:
        print(f"{name:28s} {wall * 1e3:8.0f} {worst * 1e3:13.1f} {p99 * 1e3:7.1f} {p50 * 1e3:7.2f}")
    print(f"\nsame bytes both ways: {same} ({len(next(iter(out.values()))) / 1e6:.1f} MB)")
    return 0 if same else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--entries", type=int, default=125_000, help="per rank")
    p.add_argument("--repeat", type=int, default=5)
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
