"""Prefill/decode fleets in ``kvrouter replay`` (virtual time): which runs ``--pd`` and
``--pd-sweep`` ask for, and which of them to run.

* ``--pd P:D``: a fleet of P prefill and D decode engines, policy ``kvrouter`` once per mode of
  ``--pd-mode`` (default: the router's own ``pd.mode``);
* ``--pd-sweep``: for the fleet size ``--workers`` N, policy ``kvrouter`` on N aggregated engines,
  then every ratio of ``--pd-ratios`` (default all, 1:N-1 to N-1:1) in every mode of
  ``--pd-mode`` (default ``always,threshold,cost``).

Each mode is the router's ``pd.mode`` (:mod:`router.settings.pd`) over the ``--config`` settings;
the decision itself is the placement core's (:mod:`kvrouter.replay.pd_policy`).
:func:`recommend` names the row to run for the trace (:func:`best_row`: the most goodput, then
the lower TTFT p99), a P:D ratio and mode or aggregated, beside the rows it had to beat;
:func:`explain` says why, request by request, against the one it had to beat most.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from operator import attrgetter
from typing import Any

import msgspec

from kvrouter.replay.live_client import LiveOutcome
from kvrouter.replay.report import Progress, Run
from kvrouter.replay.slo import Slo, missed, tpot_s
from kvrouter.replay.trace import TraceRequest
from kvrouter.replay.virtual import VirtualFleet, VirtualRun, run_virtual
from router.settings import PD_MODES, PdSettings, Settings

__all__ = [
    "add_pd_arguments",
    "best_row",
    "explain",
    "other_objectives",
    "parse_ratio",
    "pd_modes",
    "pd_specs",
    "ratio_mode_of",
    "recommend",
    "run_pd",
]


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode fleets (policy kvrouter; --pd live too)").add_argument
    g(
        "--pd",
        metavar="P:D",
        help="P prefill and D decode engines (instead of --workers); live, the peers "
        "vllm-router and smg drive them in their PD modes, and kvrouter-aggregated is "
        "kvrouter on P+D aggregated engines",
    )
    g(
        "--pd-mode",
        metavar="MODES",
        help=f"comma-separated, of {', '.join(PD_MODES)} (default: the router's "
        f"pd.mode, {PdSettings().mode}, with --pd; "
        "always,threshold,cost with --pd-sweep)",
    )
    g(
        "--pd-sweep",
        action="store_true",
        help="aggregated, then P:D ratios of --workers engines in each --pd-mode; names the best",
    )
    g("--pd-ratios", metavar="P:D,...", help="the sweep's ratios (default: every one)")
    g(
        "--pd-tpot-ms",
        metavar="MS,...",
        help="also name the row to run under each of these TPOT objectives (the same runs, "
        "TTFT's as --slo-ttft-ms), e.g. 25 for an interactive stream",
    )


def parse_ratio(text: str) -> tuple[int, int]:
    """``"2:6"`` -> (2, 6); both at least 1."""
    p, sep, d = text.strip().partition(":")
    try:
        ratio = (int(p), int(d))
    except ValueError:
        sep = ""
    if not sep or min(ratio) < 1:
        raise ValueError(f"a P:D ratio is two positive counts, like 2:6, not {text!r}")
    return ratio


def pd_modes(text: str | None, default: str = PdSettings().mode) -> list[str]:
    """``--pd-mode``'s modes, checked."""
    modes = [m for m in (text or default).split(",") if m]
    bad = [m for m in modes if m not in PD_MODES]
    if bad or not modes:
        raise ValueError(f"--pd-mode: {bad[0] if bad else text!r} is none of {', '.join(PD_MODES)}")
    return modes


def _with_mode(settings: Settings, mode: str) -> Settings:
    return msgspec.structs.replace(settings, pd=msgspec.structs.replace(settings.pd, mode=mode))


def pd_specs(
    args: argparse.Namespace, fleet: VirtualFleet, settings: Settings
) -> list[tuple[VirtualFleet, Settings]]:
    """The runs ``--pd`` or ``--pd-sweep`` ask for, each a fleet and the router's settings."""
    if args.pd and args.pd_sweep:
        raise ValueError("give --pd P:D or --pd-sweep, not both")
    _tpots(args)  # (a bad objective refused now, not after the runs)
    if args.pd:
        p, d = parse_ratio(args.pd)
        pd_fleet = replace(fleet, workers=p + d, prefill=p)
        return [(pd_fleet, _with_mode(settings, m)) for m in pd_modes(args.pd_mode)]
    n = fleet.workers
    if n < 2:
        raise ValueError("--pd-sweep needs at least 2 --workers")
    ratios = [parse_ratio(r) for r in args.pd_ratios.split(",")] if args.pd_ratios else []
    ratios = ratios or [(p, n - p) for p in range(1, n)]
    off = [f"{p}:{d}" for p, d in ratios if p + d != n]
    if off:
        raise ValueError(f"--pd-ratios {off[0]} is not {n} engines (--workers)")
    out = [(replace(fleet, prefill=0), settings)]
    for mode in pd_modes(args.pd_mode, "always,threshold,cost"):
        out += [(replace(fleet, prefill=p), _with_mode(settings, mode)) for p, _ in ratios]
    return out


#: a PD row's label, as :mod:`kvrouter.replay.virtual` writes it: "kvrouter 2:6 threshold"
_PD_LABEL = re.compile(r"(\d+):(\d+) (\w+)$")


def ratio_mode_of(policy: str) -> tuple[str, str] | None:
    """A PD row's ratio and mode (``"kvrouter 2:6 cost"`` -> ("2:6", "cost")); None: aggregated."""
    m = _PD_LABEL.search(policy)
    return None if m is None else (f"{m[1]}:{m[2]}", m[3])


def best_row(table: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The row to run: the most goodput, ties to the lower TTFT p99; None when none served."""
    rows = [r for r in table if r.get("goodput_rps") is not None]
    if not rows:
        return None
    return max(rows, key=lambda r: (r["goodput_rps"], -(r.get("ttft_p99_ms") or 0)))


def recommend(table: Sequence[dict[str, Any]]) -> str:
    """One line naming what to run for the trace, a P:D ratio and mode or no PD at all, with its
    goodput beside what it beat: aggregated and, for a PD row, always-PD at the same ratio (the
    two a conditional decision must not lose to). Only kvrouter's own rows are candidates: a live
    run's peers (``vllm-router 4:4 kv_aware``, ``smg 4:4``) stand beside them, and a peer's label
    would read as a PD row or as aggregated."""
    table = [r for r in table if str(r["policy"]).startswith("kvrouter ")]
    best = best_row(table)
    if best is None:
        return "no row served a request: nothing to recommend"
    ours = ratio_mode_of(str(best["policy"]))
    agg = next((r for r in table if ratio_mode_of(str(r["policy"])) is None), None)
    pd_rows = [r for r in table if ratio_mode_of(str(r["policy"])) is not None]
    gp = f"goodput {best['goodput_rps']} req/s"
    if ours is None:
        line = f"run aggregated ({best['policy']}, no PD) for this trace: {gp}"
        runner_up = best_row(pd_rows)
        if runner_up is not None:
            line += f" vs the best PD row, {_name(runner_up)}: {runner_up['goodput_rps']}"
        return line
    line = f"run {ours[0]} {ours[1]} for this trace: {gp}"
    vs = [f"{agg['policy']}: {agg['goodput_rps']}"] if agg is not None else []
    always = next(
        (r for r in pd_rows if ratio_mode_of(str(r["policy"])) == (ours[0], "always")), None
    )
    if always is not None and always is not best:
        vs.append(f"{ours[0]} always: {always['goodput_rps']}")
    return line + (f" vs {', '.join(vs)}" if vs else "")


def explain(table: Sequence[dict[str, Any]], runs: Sequence[Run], slo: Slo) -> str:
    """Why :func:`recommend`'s row beat its rival (aggregated for a PD row, the best PD row for
    aggregated), request by request: how many requests met both objectives under one and not
    the other, what the other missed on them and by how much. A goodput margin of a few requests
    reads differently when those requests missed by 1 % (prompts at the TTFT objective's edge,
    which a KV pull pushes over) than by 80 % (streams stalled by prefills). ``table`` and
    ``runs`` pair by position, as :func:`kvrouter.replay.report.row` made the one from the
    other; "" when there is no rival to explain against."""
    pairs = [(r, run) for r, run in zip(table, runs, strict=True)
             if str(r["policy"]).startswith("kvrouter ")]  # fmt: skip
    best = best_row([r for r, _ in pairs])
    if best is None:
        return ""
    if ratio_mode_of(str(best["policy"])) is None:
        rival = best_row([r for r, _ in pairs if ratio_mode_of(str(r["policy"])) is not None])
    else:
        rival = next((r for r, _ in pairs if ratio_mode_of(str(r["policy"])) is None), None)
    if rival is None:
        return ""
    run_a, run_b = (next(run for r, run in pairs if r is row) for row in (best, rival))
    # outcomes[i] is request i in every run (the client and the virtual replay both allot them)
    both = [
        (missed(o, slo), o, missed(p, slo), p)
        for o, p in zip(run_a.outcomes, run_b.outcomes, strict=True)
    ]
    lost_b = [(kp, p) for ko, _, kp, p in both if ko is None and kp]  # the rival's
    lost_a = [(ko, o) for ko, o, kp, _ in both if kp is None and ko]
    name_a, name_b = _name(best), _name(rival)
    head = f"why {name_a} over {name_b}, request by request:"
    if not lost_a and not lost_b:
        return f"{head} the same requests met both objectives under each"
    return (
        f"{head} {len(lost_b)} met both only under {name_a}{_misses(name_b, lost_b, slo)}, "
        f"{len(lost_a)} only under {name_b}{_misses(name_a, lost_a, slo)}"
    )


def _misses(who: str, kinds: Sequence[tuple[str, LiveOutcome]], slo: Slo) -> str:
    """What ``who`` made of requests the other row served in time (each with what it missed,
    from :func:`missed`), per objective: how many and how far over it, as
    " (WHO: missed TTFT on 3, by 0.8-10.4 %; no answer on 1)"."""
    parts = []
    for kind, value, limit in (
        ("ttft", attrgetter("ttft_s"), slo.ttft_s),
        ("tpot", tpot_s, slo.tpot_s),
    ):
        over = [(value(o) or 0.0) / limit - 1 for k, o in kinds if k == kind]
        if over:
            lo, hi = min(over) * 100, max(over) * 100
            by = f"{lo:.1f} %" if len(over) == 1 else f"{lo:.1f}-{hi:.1f} %"
            parts.append(f"missed {kind.upper()} on {len(over)}, by {by}")
    errors = sum(1 for k, _ in kinds if k == "error")
    if errors:
        parts.append(f"no answer on {errors}")
    return f" ({who}: {'; '.join(parts)})" if parts else ""


def other_objectives(
    args: argparse.Namespace, rows_at: Callable[[Slo], list[dict[str, Any]]]
) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """Per ``--pd-tpot-ms`` objective, from the runs as they are (``rows_at``: the table under
    an objective): the recommendation's lines (each row's goodput and share, then what to run)
    and, for the JSON, each row's goodput by objective."""
    lines: list[str] = []
    by: dict[str, list[dict[str, Any]]] = {}
    for ms in _tpots(args):
        key = f"ttft<={args.slo_ttft_ms:g}ms,tpot<={ms:g}ms"
        table = rows_at(Slo(args.slo_ttft_ms / 1000, ms / 1000))
        by[key] = [{k: r[k] for k in ("policy", "goodput_rps", "slo_%")} for r in table]
        cells = ", ".join(f"{_name(r)} {r['goodput_rps']} ({r['slo_%']} %)" for r in table)
        lines += [f"goodput with {key}: {cells}", f"  {key}: {recommend(table)}"]
    return lines, by


def _tpots(args: argparse.Namespace) -> list[float]:
    out = []
    for text in filter(str.strip, (getattr(args, "pd_tpot_ms", None) or "").split(",")):
        try:
            ms = float(text)
        except ValueError:
            ms = 0.0
        if not ms > 0:
            raise ValueError(f"--pd-tpot-ms: {text!r} is no positive number of milliseconds")
        out.append(ms)
    return out


def _name(r: dict[str, Any]) -> str:
    label = ratio_mode_of(str(r["policy"]))
    return str(r["policy"]) if label is None else " ".join(label)


def run_pd(
    args: argparse.Namespace,
    reqs: Sequence[TraceRequest],
    names: Sequence[str],
    fleet: VirtualFleet,
    settings: Settings,
) -> list[VirtualRun]:
    """Policy kvrouter on the fleets of :func:`pd_specs` (a sweep's aggregated row says so: it
    is the fleet size's baseline)."""
    if args.policies and list(names) != ["kvrouter"]:
        raise ValueError("--pd and --pd-sweep run policy kvrouter only (leave --policies out)")
    out = []
    for pd_fleet, pd_settings in pd_specs(args, fleet, settings):
        label = "kvrouter" if pd_fleet.prefill else f"kvrouter {pd_fleet.workers} aggregated"
        tick = None if args.no_progress else Progress(label, len(reqs))
        run = run_virtual(
            reqs,
            "kvrouter",
            pd_fleet,
            trace_block=args.trace_block,
            settings=pd_settings,
            seed=args.seed,
            on_done=tick,
        )
        if not pd_fleet.prefill:
            run.policy = label
        out.append(run)
    return out
