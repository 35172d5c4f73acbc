"""How much prefix reuse a router could still win under cache pressure, and from what.

Run (a few seconds per slice; no fleet, no router: the trace alone):

    python benchmarks/pressure_headroom.py --trace ../shared/traces/conversation_trace.jsonl --count 2000
    python benchmarks/pressure_headroom.py --trace ../shared/traces/synthetic_trace.jsonl --count 3000
    python benchmarks/pressure_headroom.py ... --kv-tokens 131072      # 8 x 128k instead of 8 x 256k

Issue 24 asks kvrouter to beat smg by half a point of hit rate where every engine's cache is
full. Every policy that follows prefixes lands near one pooled LRU of the fleet's size
(``kvrouter replay``'s ``of_lru_%`` column, 93-114 %). This file asks what is left above that
and which part of it a placement can reach, on the trace alone, in trace blocks (512 tokens),
answers taking room as in :func:`kvrouter.replay.trace.pooled_lru_hit`:

1. Bounds, one cache of the fleet's size shared with no copy twice:
   - ``lru``: the replay's pooled LRU (the engines' own eviction);
   - ``s3fifo``: S3-FIFO (a small probation FIFO, a main FIFO with reinsertion, a ghost list):
     what knowing *how often* a block was used buys over LRU;
   - ``opt``: Belady's eviction (the block next used furthest ahead goes first), which knows the
     future: what the capacity allows at all;
   - ``ideal``: an infinite cache.
2. The signal: of the requests whose second block is new (a first turn) and of those that matched
   more than the shared first block (a follow-up), how many have that second block used again by
   a later request, and how long after. A router knows which kind a request is when it places it.
3. ``priority``: the same pooled cache, but blocks last used by a follow-up are evicted only when
   the other blocks (first turns' and answers') are down to a share of the cache. The best a
   router reading that signal could get if it also chose what each cache evicts.
4. A toy of the placement a router does control: 8 LRU workers of ``--kv-tokens`` each, each
   request to the worker with the longest cached leading run among those within ``slack`` of
   the least loaded (load: placements among the last 64); ``victims``: a request that matches at
   most the shared first block goes instead, among the same workers, to the one whose LRU would
   evict the fewest blocks that were hit since they were stored. No time, no decode: a sketch of
   whether steering new content onto the least valuable victims pays; ``kvrouter replay`` is the
   measure.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrouter.replay.trace import (  # noqa: E402
    TraceRequest,
    ideal_hit,
    leading_run,
    load_mooncake,
    pooled_lru_hit,
)

Access = tuple[int, ...]  # one request's blocks in the order it touches them: prompt, then answer


def accesses(reqs: Sequence[TraceRequest], block: int) -> list[tuple[TraceRequest, Access]]:
    """Each request with its prompt's ids and fresh negative ids for its answer's blocks (no
    prompt uses them), as the replay's pooled LRU counts them."""
    fresh = itertools.count(-1, -1)
    return [
        (r, r.hash_ids + tuple(next(fresh) for _ in range(-(-r.output_length // block))))
        for r in reqs
    ]


def _rate(hit_blocks: Sequence[tuple[TraceRequest, int]], block: int) -> float:
    total = sum(r.input_length for r, _ in hit_blocks)
    return sum(min(n * block, r.input_length) for r, n in hit_blocks) / total


def opt_hit(reqs: Sequence[TraceRequest], block: int, slots: int) -> float:
    """Belady: on a miss past capacity, the block whose next use is furthest ahead goes."""
    acc = accesses(reqs, block)
    flat = [b for _, a in acc for b in a]
    next_use = [0] * len(flat)
    last: dict[int, int] = {}
    for k in range(len(flat) - 1, -1, -1):
        next_use[k] = last.get(flat[k], 1 << 62)
        last[flat[k]] = k
    held: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped
    out, k = [], 0
    for r, a in acc:
        out.append((r, leading_run(r.hash_ids, held)))
        for b in a:
            held[b] = next_use[k]
            heapq.heappush(heap, (-next_use[k], b))
            k += 1
        while len(held) > slots:
            nu, b = heapq.heappop(heap)
            if held.get(b) == -nu:
                del held[b]
    return _rate(out, block)


def s3fifo_hit(reqs: Sequence[TraceRequest], block: int, slots: int, small: float = 0.1) -> float:
    """S3-FIFO (Yang et al., SOSP 2023): new blocks enter a small FIFO; one used again before it
    leaves moves to the main FIFO, else it leaves a ghost that sends its next store to main."""
    s_cap = max(1, int(slots * small))
    m_cap = slots - s_cap
    s: OrderedDict[int, None] = OrderedDict()
    m: OrderedDict[int, None] = OrderedDict()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}
    out = []
    for r, a in accesses(reqs, block):
        out.append((r, leading_run(r.hash_ids, _Union(s, m))))
        for b in a:
            if b in s or b in m:
                freq[b] = min(freq.get(b, 0) + 1, 3)
                continue
            freq[b] = 0
            if b in ghost:
                del ghost[b]
                m[b] = None
            else:
                s[b] = None
            while len(s) > s_cap:
                x, _ = s.popitem(last=False)
                if freq.pop(x, 0) > 0:
                    m[x] = None
                    freq[x] = 0
                else:
                    ghost[x] = None
                    if len(ghost) > m_cap:
                        ghost.popitem(last=False)
            while len(m) > m_cap:
                x, _ = m.popitem(last=False)
                if freq.get(x, 0) > 0:
                    freq[x] -= 1
                    m[x] = None
                else:
                    freq.pop(x, None)
    return _rate(out, block)


class _Union:
    def __init__(self, *parts: OrderedDict[int, None]) -> None:
        self.parts = parts

    def __contains__(self, b: object) -> bool:
        return any(b in p for p in self.parts)


def follow_up(r: TraceRequest, seen: set[int]) -> bool:
    """More than the trace's shared first block was seen before: a later turn of something."""
    return leading_run(r.hash_ids, seen) > 1


def priority_hit(reqs: Sequence[TraceRequest], block: int, slots: int, share: float) -> float:
    """One pooled cache in two LRU classes: blocks last used by a follow-up (``hi``) are evicted
    only while the rest (``lo``: first turns' blocks and every answer's) fill at most ``share``."""
    lo: OrderedDict[int, None] = OrderedDict()
    hi: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    out = []
    for r, a in accesses(reqs, block):
        target = hi if follow_up(r, seen) else lo
        seen.update(r.hash_ids)
        out.append((r, leading_run(r.hash_ids, _Union(lo, hi))))
        for i, b in enumerate(a):
            lo.pop(b, None)
            hi.pop(b, None)
            (target if i < len(r.hash_ids) else lo)[b] = None
        while len(lo) + len(hi) > slots:
            (lo if len(lo) > share * slots or not hi else hi).popitem(last=False)
    return _rate(out, block)


def signal(reqs: Sequence[TraceRequest]) -> list[tuple[str, float, int, float, float]]:
    """(kind, share of the prompt tokens, requests with a second block, share of those whose
    second block a later request uses, mean seconds until)."""
    later: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        for b in set(r.hash_ids):
            later.setdefault(b, []).append(i)
    seen: set[int] = set()
    rows: dict[str, list[float]] = {"first turn": [0, 0, 0.0], "follow-up": [0, 0, 0.0]}
    tokens = dict.fromkeys(rows, 0)
    for i, r in enumerate(reqs):
        kind = "follow-up" if follow_up(r, seen) else "first turn"
        seen.update(r.hash_ids)
        tokens[kind] += r.input_length
        if len(r.hash_ids) < 2:
            continue
        nxt = next((j for j in later[r.hash_ids[1]] if j > i), None)
        row = rows[kind]
        row[0] += 1
        if nxt is not None:
            row[1] += 1
            row[2] += reqs[nxt].arrival_s - r.arrival_s
    total = sum(tokens.values())
    return [
        (k, tokens[k] / total, int(n), u / n if n else 0.0, g / u if u else 0.0)
        for k, (n, u, g) in rows.items()
    ]


def placement_hit(
    reqs: Sequence[TraceRequest], block: int, slots: int, workers: int, slack: int, victims: bool
) -> float:
    """The toy of section 4 of the docstring."""
    caches: list[OrderedDict[int, bool]] = [OrderedDict() for _ in range(workers)]  # -> hit since
    recent: deque[int] = deque()
    load = [0] * workers
    out = []
    for r, a in accesses(reqs, block):
        runs = [leading_run(r.hash_ids, c) for c in caches]
        floor = min(load)
        ok = [w for w in range(workers) if load[w] <= floor + slack]
        w = max(ok, key=lambda x: (runs[x], -load[x]))
        if victims and runs[w] <= 1:
            w = min(ok, key=lambda x: (_valuable_victims(caches[x], slots, len(a)), load[x]))
        c = caches[w]
        out.append((r, runs[w]))
        for i, b in enumerate(a):
            c[b] = c.pop(b, False) or i < runs[w]
        while len(c) > slots:
            c.popitem(last=False)
        recent.append(w)
        load[w] += 1
        if len(recent) > 64:
            load[recent.popleft()] -= 1
    return _rate(out, block)


def _valuable_victims(cache: OrderedDict[int, bool], slots: int, stored: int) -> int:
    need = len(cache) + stored - slots
    return sum(itertools.islice(cache.values(), max(0, need)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--trace-block", type=int, default=512)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--kv-tokens", type=int, default=262144, help="per worker")
    args = p.parse_args(argv)
    reqs = load_mooncake(args.trace, args.start, args.count)
    b = args.trace_block
    slots = args.workers * args.kv_tokens // b
    print(
        f"{Path(args.trace).name} [{args.start},{args.start + len(reqs)}), "
        f"{args.workers} x {args.kv_tokens} tokens ({slots} trace blocks pooled)\n"
    )
    bounds: list[tuple[str, Callable[[], float]]] = [
        ("pooled LRU (the engines' eviction)", lambda: pooled_lru_hit(reqs, b, slots * b)),
        ("pooled S3-FIFO (frequency-aware)", lambda: s3fifo_hit(reqs, b, slots)),
        ("pooled Belady (knows the future)", lambda: opt_hit(reqs, b, slots)),
        ("infinite cache (ideal)", lambda: ideal_hit(reqs, b)),
    ]
    print(f"{'1. bound':44s} hit")
    for name, f in bounds:
        print(f"{name:44s} {f():6.2%}")
    print(
        f"\n{'2. signal':14s} {'of prompt tokens':>17s} {'with a 2nd block':>17s} "
        f"{'2nd block used again':>21s} {'after (s)':>10s}"
    )
    for kind, share, n, used, gap in signal(reqs):
        print(f"{kind:14s} {share:17.1%} {n:17d} {used:21.1%} {gap:10.0f}")
    print(f"\n{'3. priority: first turns and answers capped at':48s} hit")
    for share in (0.2, 0.4, 0.6, 0.8):
        print(f"{share:<48.0%} {priority_hit(reqs, b, slots, share):6.2%}")
    per = args.kv_tokens // b
    print(
        f"\n{'4. toy placement, slack':24s} {'follow the cache':>17s} {'+ fewest valuable victims':>26s}"
    )
    for slack in (2, 4, 8):
        base = placement_hit(reqs, b, per, args.workers, slack, False)
        vic = placement_hit(reqs, b, per, args.workers, slack, True)
        print(f"{slack:<24d} {base:17.2%} {vic:26.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
