"""Two policies on one virtual replay slice, request by request: where their hit rates part.

    python benchmarks/replay_diff.py --trace ../shared/traces/synthetic_trace.jsonl --count 3000
    python benchmarks/replay_diff.py --trace ... --count 2000 --kv-tokens 262144 --policies kvrouter,smg

Both policies run as ``kvrouter replay`` runs them (default fleet: 8 engines, 1M tokens of KV
each; ``--kv-tokens`` as there), on the same requests. Printed: each policy's hit rate; how many
requests got a different number of cached prompt tokens, and the tokens each policy gained over
the other on them; then, for those requests, whether each policy sent the request to the worker
that holds the longest prefix of its trace blocks (``--trace-block`` tokens each) that an earlier
request placed by the same policy went to ("its prefix's worker") and yet found it evicted, or sent it to another
worker. For policy kvrouter also: of the requests where it hit less, how many it placed while
another worker held more of their prefix than the one it chose (by the index, at the decision:
it left a cache for load), against how many found no such worker. A handful of requests with large, two-way differences, on their prefix's worker and
evicted there, is the signature of which blocks one worker's LRU kept longer, not of a choice one
policy makes better (docs/replay.md, issue 24).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def record_kvrouter_choices(log: list[bool]) -> None:
    """Note, per placement, whether another worker held more of the request's prefix than the
    first in the placer's order (what policy kvrouter takes: one router, no lane); the
    decision itself is the placer's own, unchanged."""
    from router.placement import Placer

    place = Placer.place

    def noted(self: Placer, *args: Any, **kwargs: Any) -> Any:
        d = place(self, *args, **kwargs)
        most = max(c.matched_blocks for c in d.candidates)
        log.append(most > d.candidates[d.order[0]].matched_blocks)
        return d

    Placer.place = noted  # type: ignore[method-assign]


def main() -> None:
    from kvrouter.replay.trace import load_mooncake
    from kvrouter.replay.virtual import VirtualFleet, run_virtual

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--kv-tokens", type=int, default=1 << 20)
    ap.add_argument("--trace-block", type=int, default=512)
    ap.add_argument("--policies", default="kvrouter,smg_dark", help="two policies, a,b")
    args = ap.parse_args()
    a, b = args.policies.split(",")
    reqs = load_mooncake(args.trace, args.start, args.count)
    fleet = VirtualFleet(gpu_blocks=args.kv_tokens // VirtualFleet.block_size)
    left: list[bool] = []
    record_kvrouter_choices(left)
    runs = {p: run_virtual(reqs, p, fleet, trace_block=args.trace_block) for p in (a, b)}
    got = {
        p: [(o.worker, o.cached_tokens, o.prompt_tokens) for o in r.outcomes]
        for p, r in runs.items()
    }
    for p in (a, b):
        total = sum(x[2] for x in got[p])
        print(
            f"{p}: hit {100 * sum(x[1] for x in got[p]) / total:.2f} % of {total:,} prompt tokens"
        )
    differ = [i for i in range(len(reqs)) if got[a][i][1] != got[b][i][1]]
    gain = {
        p: sum(max(0, got[p][i][1] - got[q][i][1]) for i in differ) for p, q in ((a, b), (b, a))
    }
    print(f"requests with a different hit: {len(differ)} of {len(reqs)}; tokens gained on them: "
          f"{a} {gain[a]:,}, {b} {gain[b]:,}")  # fmt: skip
    for p, q in ((a, b), (b, a)):
        where: Counter[str] = Counter()
        held: dict[int, str] = {}  # trace block -> worker of the last request that had it, here
        outcome = {}
        for i, r in enumerate(reqs):
            w = got[p][i][0]
            prev = next((held[h] for h in reversed(r.hash_ids) if h in held), None)
            outcome[i] = (
                "none"
                if prev is None
                else ("its prefix's worker" if prev == w else "another worker")
            )
            for h in r.hash_ids:
                held[h] = w
        for i in differ:
            if got[p][i][1] < got[q][i][1]:
                where[outcome[i]] += 1
        print(f"  where {p} hit less than {b if p == a else a}: " + ", ".join(
            f"{k} {v}" for k, v in where.most_common()))  # fmt: skip
        if p == "kvrouter" and len(left) == len(reqs):
            worse = [i for i in differ if got[p][i][1] < got[q][i][1]]
            n = sum(left[i] for i in worse)
            print(f"    of those, placed while another worker held more of the prefix: {n}; "
                  f"none held more: {len(worse) - n} (in the whole run it left a better-cached "
                  f"worker {sum(left)} times)")  # fmt: skip


if __name__ == "__main__":
    main()
