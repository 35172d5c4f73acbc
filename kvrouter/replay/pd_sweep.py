"""Prefill/decode fleets in ``kvrouter replay`` (virtual time): which runs ``--pd`` and
``--pd-sweep`` ask for, and which of them to run.

* ``--pd P:D``: a fleet of P prefill and D decode engines, policy ``kvrouter`` once per mode of
  ``--pd-mode`` (default ``threshold``, the router's own default);
* ``--pd-sweep``: for the fleet size ``--workers`` N, policy ``kvrouter`` on N aggregated engines,
  then every ratio of ``--pd-ratios`` (default all, 1:N-1 to N-1:1) in every mode of
  ``--pd-mode`` (default ``always,threshold,cost``).

Each mode is the router's ``pd.mode`` (:mod:`router.settings.pd`) over the ``--config`` settings;
the decision itself is the placement core's (:mod:`kvrouter.replay.pd_policy`).
:func:`recommend` names the row to run: the most goodput, then the lower TTFT p99.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec

from kvrouter.replay.report import Progress
from kvrouter.replay.trace import TraceRequest
from kvrouter.replay.virtual import VirtualFleet, VirtualRun, run_virtual
from router.settings import PD_MODES, Settings

__all__ = ["add_pd_arguments", "parse_ratio", "pd_modes", "pd_specs", "recommend", "run_pd"]


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
        help=f"comma-separated, of {', '.join(PD_MODES)} (default: threshold with --pd; "
        "always,threshold,cost with --pd-sweep)",
    )
    g(
        "--pd-sweep",
        action="store_true",
        help="aggregated, then P:D ratios of --workers engines in each --pd-mode; names the best",
    )
    g("--pd-ratios", metavar="P:D,...", help="the sweep's ratios (default: every one)")


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


def pd_modes(text: str | None, default: str = "threshold") -> list[str]:
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
    if args.pd:
        p, d = parse_ratio(args.pd)
        pd_fleet = replace(fleet, workers=p + d, prefill=p)
        return [(pd_fleet, _with_mode(settings, m)) for m in pd_modes(args.pd_mode, "threshold")]
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


def recommend(table: Sequence[dict[str, Any]]) -> str:
    """One line naming the row to run: the most goodput, ties to the lower TTFT p99."""
    rows = [r for r in table if r.get("goodput_rps") is not None]
    if not rows:
        return "no row served a request: nothing to recommend"
    best = max(rows, key=lambda r: (r["goodput_rps"], -(r.get("ttft_p99_ms") or 0)))
    agg = next((r for r in rows if "remote_%" not in r), None)
    line = f"run: {best['policy']} (goodput {best['goodput_rps']} req/s"
    if agg is not None and agg is not best:
        line += f"; aggregated {agg['policy']}: {agg['goodput_rps']} req/s"
    return line + ")"


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
