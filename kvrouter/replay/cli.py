"""``kvrouter replay``: a workload through every policy, one after another, and a table.

    kvrouter replay --trace ../shared/traces/conversation_trace.jsonl --count 2000 \\
        --json out/virtual-conversation.json --plots out/virtual-conversation
    kvrouter replay --workload shared-prefix --groups 8 --prompts 32 --turns 3
    kvrouter replay --trace ... --count 2000 --kv-tokens 262144   # caches under pressure
    kvrouter replay --trace ... --count 1000 --pd-sweep --pd-ratios 2:6,4:4 --plots out/pd
    kvrouter replay --mode live --trace ... --count 1000 --speedup 1.25 \\
        --policies round_robin,least_load,kvrouter,sglang --sglang-router-python /tmp/sgl/bin/python

Virtual time (default) runs the bundled engines and the router in this process on a simulated
clock (:mod:`kvrouter.replay.virtual`); live sends the same requests to running servers
(:mod:`kvrouter.replay.live`). ``--config`` is a router YAML: its ``scoring`` section is what
policy ``kvrouter`` places with in both modes (and its ``pd`` section on a prefill/decode fleet,
``--pd`` and ``--pd-sweep``: :mod:`kvrouter.replay.pd_sweep`, virtual time).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvrouter.replay.slo import DEFAULT_SLO, Slo
from kvrouter.replay.trace import (
    SharedPrefixSpec,
    TraceError,
    TraceRequest,
    check_block_sizes,
    ideal_hit,
    load_mooncake,
    pooled_lru_hit,
    prompt_text,
    scale_rate,
    shared_prefix,
    spread_ties,
)
from router.errors import ConfigError

__all__ = ["main"]

VIRTUAL_DEFAULT = "random,round_robin,least_load,kvrouter,cache_aware,smg,oracle"
LIVE_DEFAULT = "round_robin,least_load,kvrouter"


def _parser() -> argparse.ArgumentParser:
    from kvrouter.replay.faults import add_fault_arguments
    from kvrouter.replay.live import add_live_arguments
    from kvrouter.replay.pd_sweep import add_pd_arguments

    p = argparse.ArgumentParser(
        prog="kvrouter replay",
        description=_plain(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument_group("workload and output (both modes)").add_argument
    a("--mode", choices=("virtual", "live"), default="virtual", help="(default virtual)")
    a("--trace", help="Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)")
    a(
        "--workload",
        choices=("trace", "shared-prefix"),
        default="trace",
        help="the --trace file (default), or a generated shared-prefix one",
    )
    a("--start", type=int, default=0, help="first trace record (default 0)")
    a("--count", type=int, default=None, help="records to replay (default: all)")
    a("--trace-block", type=int, default=512, help="tokens per trace hash id (default 512)")
    a(
        "--arrival-spread-ms",
        type=float,
        default=0.0,
        metavar="W",
        help="requests sharing a timestamp arrive evenly over the next W ms instead of at once "
        "(default 0: as the trace says; conversation's timestamps come in 3,000 ms steps)",
    )
    a(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="arrivals F times as fast (timestamp / F), the engines as they are: a heavier load "
        "(default 1: the trace's own rate)",
    )
    a("--policies", help=f"comma-separated (virtual: {VIRTUAL_DEFAULT}; live: {LIVE_DEFAULT})")
    a("--config", help="router YAML whose scoring policy kvrouter uses")
    a("--seed", type=int, default=0, help="for the random choices (default 0)")
    a("--json", metavar="PATH", help="write the table and the arguments here")
    a("--dump-requests", metavar="PATH", help="one JSON line per request of every run, here")
    a("--plots", metavar="DIR", help="write ttft_cdf.png and hit_rate.png here")
    a("--no-progress", action="store_true", help="no progress on stderr")
    a(
        "--slo-ttft-ms",
        type=float,
        default=DEFAULT_SLO.ttft_s * 1000,
        help="goodput's time-to-first-token objective "
        f"(default {DEFAULT_SLO.ttft_s * 1000:g}; kvrouter.replay.slo)",
    )
    a(
        "--slo-tpot-ms",
        type=float,
        default=DEFAULT_SLO.tpot_s * 1000,
        help=f"goodput's time-per-output-token objective (default {DEFAULT_SLO.tpot_s * 1000:g})",
    )
    f = p.add_argument_group("fleet (both modes)")
    f.add_argument("--workers", type=int, default=8, help="(default 8)")
    f.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    f.add_argument("--gpu-blocks", type=int, default=65536, help="per worker (default 65536)")
    f.add_argument(
        "--kv-tokens",
        type=int,
        metavar="N",
        help="KV tokens per worker, instead of --gpu-blocks (e.g. 262144 or 131072: caches that "
        "evict what the trace reuses)",
    )
    f.add_argument(
        "--no-events",
        type=int,
        default=0,
        metavar="K",
        help="policy kvrouter (one router): K of the workers publish no KV events, routed on "
        "what the router sent them (default 0)",
    )
    add_fault_arguments(f)
    v = p.add_argument_group("virtual time (--mode virtual)")
    v.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="an engine's tokens per step (default 2048)",
    )
    v.add_argument(
        "--max-num-seqs", type=int, default=64, help="an engine's running requests (default 64)"
    )
    v.add_argument("--event-delay-ms", type=float, default=5.0, help="events reach the index late")
    v.add_argument(
        "--sim-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="sim runner timing override (repeatable), e.g. decode_d2=4e-5",
    )
    v.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        metavar="R",
        help="policy kvrouter through R routers, each request to one at random (default 1); "
        "R > 1 adds their row(s) after the one router's",
    )
    v.add_argument(
        "--replica-sync",
        choices=("on", "off", "both"),
        default="on",
        help="replicas apply each other's placements (default on; both: a row for each)",
    )
    v.add_argument(
        "--sync-delay-ms", type=float, default=5.0, help="a placement reaches the peers late"
    )
    g = p.add_argument_group("generated shared-prefix workload (--workload shared-prefix)")
    for name, default in vars(SharedPrefixSpec()).items():
        if name != "seed":
            flag = f"--{name.replace('_', '-')}"
            g.add_argument(flag, type=type(default), default=default, help=f"(default {default})")
    add_pd_arguments(p)
    add_live_arguments(p)
    return p


def _plain(doc: str) -> str:
    """A docstring as --help shows it: no Sphinx roles (:mod:`x` -> x), no ``literal`` marks."""
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", doc).replace("``", "")


def _workload(args: argparse.Namespace) -> list[TraceRequest]:
    if args.workload == "shared-prefix":
        fields = {k: getattr(args, k) for k in vars(SharedPrefixSpec()) if k != "seed"}
        reqs = shared_prefix(SharedPrefixSpec(**fields, seed=args.seed), args.trace_block)
        reqs = reqs[args.start : None if args.count is None else args.start + args.count]
        return scale_rate(reqs, args.rate_scale)
    if not args.trace:
        raise TraceError("give --trace FILE (or --workload shared-prefix)")
    if args.arrival_spread_ms < 0:
        raise TraceError(f"--arrival-spread-ms must not be negative, got {args.arrival_spread_ms}")
    reqs = load_mooncake(args.trace, args.start, args.count)
    return scale_rate(spread_ties(reqs, args.arrival_spread_ms / 1000), args.rate_scale)


def _sim_options(items: Sequence[str]) -> dict[str, float]:
    out = {}
    for item in items:
        k, eq, v = item.partition("=")
        try:
            out[k] = float(v)
        except ValueError:
            eq = ""
        if not eq:
            raise TraceError(f"--sim-option wants NAME=NUMBER, got {item!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.plots:  # now, not after a run of minutes
            from kvrouter.replay.plots import check_plotting

            check_plotting()
        if args.kv_tokens is not None:
            if args.kv_tokens <= 0 or args.kv_tokens % args.block_size:
                raise TraceError(
                    f"--kv-tokens must be a positive multiple of --block-size ({args.block_size})"
                )
            args.gpu_blocks = args.kv_tokens // args.block_size
        slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
        pd = bool(args.pd or args.pd_sweep)
        if args.pd_sweep and args.mode != "virtual":
            raise ValueError("--pd-sweep runs in virtual time only (--mode virtual)")
        if args.pd:
            from kvrouter.replay.pd_sweep import parse_ratio

            args.workers = sum(parse_ratio(args.pd))
        reqs = _workload(args)
        check_block_sizes(args.trace_block, args.block_size, reqs)
        policies = args.policies or (VIRTUAL_DEFAULT if args.mode == "virtual" else LIVE_DEFAULT)
        names = [p for p in policies.split(",") if p]
        run = _run_virtual if args.mode == "virtual" else _run_live
        runs = run(args, reqs, names)
    except (TraceError, ValueError, ConfigError) as e:
        print(f"kvrouter replay: {e}", file=sys.stderr)
        return 2
    from kvrouter.replay.report import error_kinds, format_table, row, write_json, write_requests

    ideal = ideal_hit(reqs, args.trace_block)
    capacity = args.workers * args.gpu_blocks * args.block_size
    pooled = pooled_lru_hit(reqs, args.trace_block, capacity)
    table = [row(r, ideal, pooled, slo) for r in runs]
    where = Path(args.trace).name if args.workload == "trace" else "shared-prefix"
    rate = f" at {args.rate_scale:g}x its rate" if args.rate_scale != 1 else ""
    caption = (
        f"{args.mode}: {where} [{args.start},{args.start + len(reqs)}) {len(reqs)} requests{rate}, "
        f"{args.workers} workers x {args.gpu_blocks * args.block_size:,} tokens"
    )
    title = (
        f"{caption}, infinite-cache ideal {ideal:.1%}, one pooled LRU cache of the fleet's size "
        f"{pooled:.1%}; goodput: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
        f"{args.slo_tpot_ms:g} ms"
    )
    print(format_table(title, table))
    errors = {r.policy: error_kinds(r) for r in runs if any(o.error for o in r.outcomes)}
    for policy, kinds in errors.items():
        for message, n in kinds.items():
            print(f"  {policy}: {n} x {message}")
    by_objective: dict[str, Any] = {}
    advice: dict[str, str] = {}  # what to run and why, for the JSON too
    if pd:
        from kvrouter.replay.pd_sweep import explain, other_objectives, recommend

        advice = {"run": recommend(table), "why": explain(table, runs, slo)}
        print("\n".join(filter(None, advice.values())))
        lines, by_objective = other_objectives(
            args, lambda s: [row(r, ideal, pooled, s) for r in runs]
        )
        for line in lines:
            print(line)
    if args.json:
        meta: dict[str, Any] = {
            "args": vars(args),
            "ideal": ideal,
            "pooled_lru": pooled,
            "requests": len(reqs),
            "errors": errors,
            **({"goodput_by_objective": by_objective} if by_objective else {}),
            **({"recommendation": advice} if advice else {}),
        }
        if args.mode == "virtual":
            meta["wall_s"] = {r.policy: round(r.wall_s, 1) for r in runs}
        write_json(args.json, meta, table)
    if args.dump_requests:
        write_requests(args.dump_requests, runs, args.start)
    if args.plots:
        from kvrouter.replay.plots import plot

        paths = plot(Path(args.plots), runs, table, ideal, pooled, caption)
        if args.pd_sweep:
            from kvrouter.replay.plots import plot_pd_sweep

            paths.append(plot_pd_sweep(Path(args.plots), table, caption))
        print("plots:", *paths)
    return 0


def _run_virtual(args: argparse.Namespace, reqs: list[TraceRequest], names: list[str]) -> list:
    from kvrouter.replay.factory import VIRTUAL_POLICIES
    from kvrouter.replay.faults import faults_of
    from kvrouter.replay.replicas import replica_runs
    from kvrouter.replay.report import Progress
    from kvrouter.replay.virtual import VirtualFleet, run_virtual
    from router.settings import load_settings

    bad = [n for n in names if n not in VIRTUAL_POLICIES]
    if bad:
        raise ValueError(
            f"unknown virtual-time policy {bad[0]!r} (known: {', '.join(VIRTUAL_POLICIES)})"
        )
    settings = load_settings(args.config, environ={}, overrides={"block_size": args.block_size})
    fleet = VirtualFleet(
        workers=args.workers,
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        event_delay_s=args.event_delay_ms / 1000,
        no_events=max(0, min(args.no_events, args.workers)),
        sim_options=_sim_options(args.sim_option),
        faults=faults_of(args),
    )
    if args.pd or args.pd_sweep:
        from kvrouter.replay.pd_sweep import run_pd

        return run_pd(args, reqs, names, fleet, settings)
    out = []
    for name in names:
        for replicas in replica_runs(args) if name == "kvrouter" else [None]:
            label = replicas.label if replicas is not None else name
            tick = None if args.no_progress else Progress(label, len(reqs))
            out.append(
                run_virtual(
                    reqs,
                    name,
                    fleet,
                    trace_block=args.trace_block,
                    settings=settings,
                    seed=args.seed,
                    on_done=tick,
                    replicas=replicas,
                )
            )
    return out


def _run_live(args: argparse.Namespace, reqs: list[TraceRequest], names: list[str]) -> list:
    from kvrouter.replay.live import run_policy, targets_from_args
    from kvrouter.replay.live_client import LiveRequest
    from kvrouter.replay.report import Progress

    size = args.trace_block
    live = [
        LiveRequest(r.arrival_s, lambda r=r: prompt_text(r, size), r.output_length) for r in reqs
    ]
    if args.config and not args.router_config:
        args.router_config = args.config
    targets = targets_from_args(
        args,
        workers=args.workers,
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        speedup=args.speedup,
    )
    runs = [(name, targets) for name in names]
    if args.pd:  # kvrouter once per --pd-mode (default: the router's own), vllm-router per policy
        from kvrouter.replay.pd_sweep import pd_modes

        modes = pd_modes(args.pd_mode) if args.pd_mode else [None]
        vllm = [p for p in args.vllm_router_policy.split(",") if p]
        runs = []
        for n in names:
            if n == "kvrouter":
                runs += [(n, replace(targets, pd_mode=m)) for m in modes]
            elif n == "vllm-router":
                runs += [(n, replace(targets, vllm_router_policy=v)) for v in vllm]
            else:
                runs.append((n, targets))
    out = []
    with open(args.children_log or os.devnull, "w") as log:
        for name, where in runs:
            tick = None if args.no_progress else Progress(name, len(reqs))
            out.append(
                run_policy(
                    name,
                    live,
                    where,
                    speedup=args.speedup,
                    seed=args.seed,
                    max_inflight=args.max_inflight,
                    log=log,
                    on_done=tick,
                )
            )
    return out
