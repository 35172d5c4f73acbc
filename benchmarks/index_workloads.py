"""The index half of ``benchmarks/bench_ingest.py`` (its ``--only match`` and ``--only memory``):
``match_workload`` (documents with shared system prompts, each worker caching random-length
prefixes of some, as chained ``BlockStored`` events; ``bench_route.py`` routes over the same
state), the match latency rows and the bytes per index entry."""

from __future__ import annotations

import gc
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from indexer.events import BlockStored
from indexer.index import PrefixIndex

BS = 16
BLOCKS_PER_EVENT = 16
_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def match_workload(
    workers: int, docs_per_worker: int, seed: int = 0
) -> tuple[list[list[int]], Iterator[tuple[int, BlockStored]]]:
    """The match benchmark's state, also ``bench_route.py``'s: 64 documents of 32,768 tokens
    (4 shared 1,024-token system prompts); each worker caches random-length prefixes of
    ``docs_per_worker`` of them, announced as (worker, chained ``BlockStored`` of 16 blocks)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(50_000) for _ in range(1024)] for _ in range(4)]
    docs = [
        prompts[d % 4] + [rng.randrange(50_000) for _ in range(32_768 - 1024)] for d in range(64)
    ]

    def events() -> Iterator[tuple[int, BlockStored]]:
        eh = 1
        step = BS * BLOCKS_PER_EVENT
        for w in range(workers):
            for _ in range(docs_per_worker):
                d = docs[rng.randrange(len(docs))]
                n = rng.randrange(1, 2049) * BS
                parent = None
                for s in range(0, n, step):
                    chunk = d[s : min(s + step, n)]
                    nb = len(chunk) // BS
                    # engine hashes look like vLLM's: unsigned 64-bit values
                    hashes = [(x * _GOLDEN) & _M64 for x in range(eh, eh + nb)]
                    eh += nb
                    yield w, BlockStored(hashes, parent, chunk, BS)
                    parent = hashes[-1]

    return docs, events()


def build_index(workers: int, docs_per_worker: int, seed: int = 0) -> tuple[PrefixIndex, list]:
    docs, events = match_workload(workers, docs_per_worker, seed)
    idx = PrefixIndex(BS)
    for w in range(workers):
        idx.add_worker(f"w{w}", 0)
    for w, ev in events:
        idx.apply_event((f"w{w}", 0), ev)
    return idx, docs


def bench_match(rounds: int) -> list[tuple]:
    rows = []
    for workers, per in ((8, 16), (64, 8), (512, 2)):
        idx, docs = build_index(workers, per)
        rng = random.Random(1)
        for ntok in (512, 4096, 32_768):
            queries = [docs[rng.randrange(len(docs))][:ntok] for _ in range(200)]
            lat = []
            n = rounds if ntok < 32_768 else max(200, rounds // 4)
            for i in range(n):
                q = queries[i % len(queries)]
                t0 = time.perf_counter()
                idx.match(idx.request_hashes(q))
                lat.append(time.perf_counter() - t0)
            lat.sort()
            rows.append((ntok, workers, idx.entries(), _pct(lat, 0.5) * 1e6, _pct(lat, 0.99) * 1e6))
    return rows


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _traced(build) -> tuple[PrefixIndex, int, int]:
    """Python heap growth (tracemalloc) and RSS growth while ``build()`` makes an index."""
    gc.collect()
    rss0 = _rss()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = build()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    gc.collect()
    return idx, used, _rss() - rss0


def _unshared(workers: int, blocks_per_worker: int) -> PrefixIndex:
    idx = PrefixIndex(BS)
    step = BS * BLOCKS_PER_EVENT
    for w in range(workers):
        key = (f"w{w}", 0)
        idx.add_worker(*key)
        base = w * blocks_per_worker * BS
        parent = None
        for s in range(0, blocks_per_worker * BS, step):
            e = (base + s) // BS
            hashes = [(x * _GOLDEN) & _M64 for x in range(e + 1, e + 1 + BLOCKS_PER_EVENT)]
            idx.apply_event(
                key, BlockStored(hashes, parent, list(range(base + s, base + s + step)), BS)
            )
            parent = None if (s // step) % 64 == 63 else hashes[-1]
    return idx


def bench_memory() -> list[tuple[str, int, int, float, float | None]]:
    rows = []
    # shared prefixes: 64 workers holding prefixes of the same documents (docs measured apart)
    rng = random.Random(0)
    prompts = [[rng.randrange(50_000) for _ in range(1024)] for _ in range(4)]
    tracemalloc.start()
    b0 = tracemalloc.get_traced_memory()[0]
    docs = [
        prompts[d % 4] + [rng.randrange(50_000) for _ in range(32_768 - 1024)] for d in range(64)
    ]
    docs_bytes = tracemalloc.get_traced_memory()[0] - b0
    tracemalloc.stop()
    del docs
    idx, used, _ = _traced(lambda: build_index(64, 15)[0])
    n = idx.entries()
    rows.append(("64 workers, shared prefixes", n, len(idx), (used - docs_bytes) / n, None))
    del idx
    idx, used, rss = _traced(lambda: _unshared(8, 125_000))
    n = idx.entries()
    rows.append(("8 workers, nothing shared", n, len(idx), used / n, rss / n))
    return rows
