"""Routing quality, live: a slice of a Mooncake trace through each policy on a fresh fleet of
bundled sim engines, one policy after another in one run, and a table per policy.

Run (about 5 minutes per policy for 1,000 conversation requests at --speedup 1.25; nothing else
should be running — on a busy machine TTFT is mostly CPU contention):

    python benchmarks/bench_replay_live.py --trace ../shared/traces/conversation_trace.jsonl \\
        --start 0 --count 1000 --speedup 1.25 --workers 8 --gpu-blocks 65536 \\
        --policies round_robin,least_load,kvrouter,sglang \\
        --sglang-router-python /tmp/sgl/bin/python --json out/live-conversation.json
    python benchmarks/bench_replay_live.py --trace ... --count 60 --speedup 5 --workers 2 \\
        --gpu-blocks 8192 --policies round_robin,kvrouter                   # a quick check

sglang-router is never a dependency of this repository: make its Python with
``python -m venv /tmp/sgl && /tmp/sgl/bin/pip install sglang-router==0.3.2``.

Each trace block id (512 tokens) becomes 512 deterministic ASCII characters (the bundled engine's
byte tokenizer makes them 512 tokens), so equal ids give equal engine blocks at any block size
dividing 512. The engines run at the replay's ``--speedup`` too, so the fleet is the trace's fleet
with every clock sped up. This is the interim entry point of live mode; it goes away when
``kvrouter replay --mode live`` (same options, shared trace loading and report) exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvrouter.replay.live import (  # noqa: E402
    LiveTargets,
    PolicyRun,
    add_live_arguments,
    run_policy,
    targets_from_args,
)
from kvrouter.replay.live_client import LiveRequest  # noqa: E402

_ALPHABET = (string.ascii_letters + string.digits).encode()


def block_text(block_id: int, size: int) -> str:
    digest = hashlib.shake_128(b"kvrouter-block:%d" % block_id).digest(size)
    return bytes(_ALPHABET[b % len(_ALPHABET)] for b in digest).decode()


def load(path: str, start: int, count: int) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for i, line in enumerate(f) if start <= i < start + count]
    if not rows:
        raise SystemExit(f"{path}: no records in [{start}, {start + count})")
    return rows


def requests(rows: list[dict], trace_block: int) -> list[LiveRequest]:
    cache: dict[int, str] = {}

    def text(ids: list[int], n: int) -> str:
        parts = [cache.get(b) or cache.setdefault(b, block_text(b, trace_block)) for b in ids]
        return "".join(parts)[:n]

    t0 = rows[0]["timestamp"]
    return [
        LiveRequest(
            (r["timestamp"] - t0) / 1000,
            lambda r=r: text(r["hash_ids"], r["input_length"]),
            int(r["output_length"]),
        )
        for r in rows
    ]


def ideal_hit(rows: list[dict], trace_block: int) -> float:
    """Σ reusable / Σ prompt tokens with an infinite cache: each request's leading run of
    blocks that some earlier request held (ids are chained: equal id = equal prefix)."""
    seen: set[int] = set()
    hit = 0
    for r in rows:
        run = 0
        for b in r["hash_ids"]:
            if b not in seen:
                break
            run += 1
        hit += min(run * trace_block, r["input_length"])
        seen.update(r["hash_ids"])
    return hit / sum(r["input_length"] for r in rows)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def row(run: PolicyRun, ideal: float) -> dict[str, object]:
    ok = [o for o in run.outcomes if o.error is None]
    ttft = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    e2e = sorted(o.e2e_s for o in ok if o.e2e_s is not None)
    hit = sum(o.cached_tokens for o in ok) / max(1, sum(o.prompt_tokens for o in ok))
    reqs = [e.requests for e in run.engines] or [0]
    toks = [e.prompt_tokens for e in run.engines] or [0]
    cpu = None if run.router_cpu_s is None else run.router_cpu_s / len(run.outcomes) * 1000
    return {
        "policy": run.policy,
        "ok": len(ok),
        "errors": len(run.outcomes) - len(ok),
        "hit_%": round(hit * 100, 1),
        "of_ideal_%": round(hit / ideal * 100) if ideal else None,
        "ttft_mean_ms": round(statistics.mean(ttft) * 1000) if ttft else None,
        "ttft_p50_ms": round(_pct(ttft, 0.5)),
        "ttft_p99_ms": round(_pct(ttft, 0.99)),
        "e2e_p50_ms": round(_pct(e2e, 0.5)),
        "e2e_p99_ms": round(_pct(e2e, 0.99)),
        "req/worker": f"{max(reqs)}/{min(reqs)}",
        "Mtok/worker": f"{max(toks) / 1e6:.2f}/{min(toks) / 1e6:.2f}",
        "preempt": sum(e.preemptions for e in run.engines),
        "cpu_s/1k": None if cpu is None else round(cpu, 1),
        "late_max_s": round(max(o.late_s for o in run.outcomes), 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", required=True, help="Mooncake JSONL")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--trace-block", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--speedup", type=float, default=1.25)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=65536)
    p.add_argument("--policies", default="round_robin,least_load,kvrouter,sglang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every request's outcome and the table here")
    p.add_argument("--plots", help="directory for ttft_cdf.png and hit_rate.png")
    add_live_arguments(p)
    args = p.parse_args()
    rows = load(args.trace, args.start, args.count)
    reqs = requests(rows, args.trace_block)
    ideal = ideal_hit(rows, args.trace_block)
    targets: LiveTargets = targets_from_args(
        args,
        workers=args.workers,
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        speedup=args.speedup,
    )
    log = open(args.children_log or os.devnull, "w")  # noqa: SIM115 - closed below
    table, runs = [], []
    with log:
        for policy in args.policies.split(","):
            load_avg = round(os.getloadavg()[0], 2)  # how busy the machine was as it began
            done = 0

            def tick(_: object, policy: str = policy) -> None:
                nonlocal done
                done += 1
                if done % max(1, len(reqs) // 20) == 0 or done == len(reqs):
                    print(f"\r{policy}: {done}/{len(reqs)}", end="", file=sys.stderr, flush=True)

            run = run_policy(
                policy, reqs, targets, speedup=args.speedup, seed=args.seed,
                max_inflight=args.max_inflight, log=log, on_done=tick,
            )  # fmt: skip
            print(file=sys.stderr)
            table.append({**row(run, ideal), "load_1m": load_avg})
            runs.append(run)
    keys = list(table[0])
    widths = [max(len(k), *(len(str(r[k])) for r in table)) for k in keys]
    print(f"{Path(args.trace).name} [{args.start},{args.start + args.count}) ideal {ideal:.1%}")
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in table:
        print("  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))
    if args.json:
        out = {
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "ideal": ideal,
            "table": table,
            "runs": [dataclasses.asdict(r) for r in runs],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out))
    if args.plots:
        plot(Path(args.plots), runs, table, ideal)
    return 0


def plot(out: Path, runs: list[PolicyRun], table: list[dict[str, object]], ideal: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        s = sorted(o.ttft_s * 1000 for o in run.outcomes if o.ttft_s is not None)
        ax.plot(s, [i / len(s) for i in range(len(s))], label=run.policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.savefig(out / "ttft_cdf.png", dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [str(r["policy"]) for r in table]
    ax.bar(names, [float(r["hit_%"]) for r in table])  # type: ignore[arg-type]
    ax.axhline(ideal * 100, linestyle="--", color="gray", label="infinite-cache ideal")
    ax.set_ylabel("prefix hit (% of prompt tokens)")
    ax.legend()
    fig.savefig(out / "hit_rate.png", dpi=120, bbox_inches="tight")
    print(f"plots: {out / 'ttft_cdf.png'} {out / 'hit_rate.png'}")


if __name__ == "__main__":
    raise SystemExit(main())
