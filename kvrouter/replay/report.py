"""What a replay prints and writes: one row per policy, a JSON file, its progress (the two PNG plots:
:mod:`kvrouter.replay.plots`).

A row (:func:`row`): requests served and failed; prefix hit rate (Σ cached / Σ prompt tokens, the
engines' own ``cached_tokens``), its fraction of the infinite-cache ideal and of one pooled LRU
cache of the fleet's size (what a single shared cache keeps: the ideal under a finite cache); TTFT mean/p50/p99,
time per output token mean/p99 and end-to-end p50/p99 in milliseconds; goodput (requests per second
meeting both objectives of a :class:`kvrouter.replay.slo.Slo`) and the share of requests that met
them; requests and prompt tokens per worker (max/min); preemptions;
in live mode the router's CPU seconds per 1,000 requests (and Envoy's, for policy kvrouter-epp)
and how late the client sent the latest request. Times are simulated seconds in virtual time and
wall-clock seconds live.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from kvrouter.replay.fleet import EngineCounters
from kvrouter.replay.live_client import LiveOutcome
from kvrouter.replay.slo import DEFAULT_SLO, Slo, good, tpot_s

__all__ = [
    "Progress",
    "Run",
    "error_kinds",
    "format_table",
    "row",
    "span_s",
    "write_json",
    "write_requests",
]


class Run(Protocol):
    policy: str
    outcomes: list[LiveOutcome]
    engines: list[EngineCounters]


def _pct(xs: Sequence[float], q: float) -> float | None:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000) if xs else None


def span_s(run: Run) -> float:
    """The run's span for rates: simulated seconds in virtual time (a virtual run's ``wall_s`` is
    how long this machine took to simulate it, not the fleet's time), else wall-clock seconds."""
    sim = getattr(run, "sim_s", None)
    return float(sim if sim is not None else getattr(run, "wall_s", 0.0))


def _ms1(xs: Sequence[float], q: float | None = None) -> float | None:
    """Milliseconds with one decimal (a TPOT is tens of ms: whole ms would hide differences);
    the mean, or the ``q`` quantile as :func:`_pct` takes it."""
    if not xs:
        return None
    v = statistics.mean(xs) if q is None else xs[min(len(xs) - 1, int(q * len(xs)))]
    return round(v * 1000, 1)


def row(
    run: Run, ideal: float, pooled: float | None = None, slo: Slo = DEFAULT_SLO
) -> dict[str, Any]:
    ok = [o for o in run.outcomes if o.error is None]
    ttft = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    e2e = sorted(o.e2e_s for o in ok if o.e2e_s is not None)
    tpot = sorted(t for t in map(tpot_s, ok) if t is not None)
    met = sum(1 for o in run.outcomes if good(o, slo))
    span = span_s(run)
    hit = sum(o.cached_tokens for o in ok) / max(1, sum(o.prompt_tokens for o in ok))
    reqs = [e.requests for e in run.engines] or [0]
    toks = [e.prompt_tokens for e in run.engines] or [0]
    out: dict[str, Any] = {
        "policy": run.policy,
        "ok": len(ok),
        "errors": len(run.outcomes) - len(ok),
        "hit_%": round(hit * 100, 1),
        "of_ideal_%": round(hit / ideal * 100) if ideal else None,
        "of_lru_%": round(hit / pooled * 100) if pooled else None,
        "ttft_mean_ms": round(statistics.mean(ttft) * 1000) if ttft else None,
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "tpot_mean_ms": _ms1(tpot),
        "tpot_p99_ms": _ms1(tpot, 0.99),
        "goodput_rps": round(met / span, 3) if span > 0 else None,
        "slo_%": round(met / len(run.outcomes) * 100, 1) if run.outcomes else None,
        "e2e_p50_ms": _pct(e2e, 0.5),
        "e2e_p99_ms": _pct(e2e, 0.99),
        "req/worker": f"{max(reqs)}/{min(reqs)}",
        "Mtok/worker": f"{max(toks) / 1e6:.2f}/{min(toks) / 1e6:.2f}",
        "preempt": sum(e.preemptions for e in run.engines),
    }
    out.update(getattr(run, "extra", None) or {})  # (a PD run's own columns)
    cpu = getattr(run, "router_cpu_s", None)
    if hasattr(run, "router_cpu_s"):
        out["cpu_s/1k"] = None if cpu is None else round(cpu / len(run.outcomes) * 1000, 1)
        gateway = getattr(run, "gateway_cpu_s", None)
        if gateway is not None:  # (policy kvrouter-epp: Envoy's, besides the router's)
            out["envoy_cpu_s/1k"] = round(gateway / len(run.outcomes) * 1000, 1)
        out["late_max_s"] = round(max((o.late_s for o in run.outcomes), default=0.0), 2)
    return out


def error_kinds(run: Run, limit: int = 5) -> dict[str, int]:
    """The most frequent failure messages of a run and how often each came (a failed request
    counts in ``errors``; this says what it was)."""
    counts: dict[str, int] = {}
    for o in run.outcomes:
        if o.error is not None:
            key = o.error[:160]
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:limit])


def format_table(title: str, table: Sequence[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys(k for r in table for k in r))
    cells = [[_cell(r.get(k)) for k in keys] for r in table]
    widths = [max(len(k), *(len(row[i]) for row in cells)) for i, k in enumerate(keys)]
    lines = [title, "  ".join(k.ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    # no value (a column only some rows have, no ideal to compare with, no CPU reading): "-",
    # never Python's "None"
    return "-" if value is None else str(value)


def write_json(path: str | Path, meta: dict[str, Any], table: Sequence[dict[str, Any]]) -> None:
    """The table and the arguments; per-request outcomes stay out (12k rows per policy)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({**meta, "table": list(table)}, indent=1))


def write_requests(path: str | Path, runs: Sequence[Run], first: int = 0) -> None:
    """One JSON line per request of every run (``--dump-requests``): where it went and how it
    fared, so a table's tail can be read request by request (which answers a TPOT p99 is made
    of, and beside what). ``first``: the trace record of a run's first request. Times in ms;
    ``tpot_ms`` is null for an answer of one token."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for run in runs:
            for o in run.outcomes:
                times = (o.ttft_s, o.e2e_s, tpot_s(o))
                ms = [None if x is None else round(x * 1000, 2) for x in times]
                line = {
                    "policy": run.policy,
                    "record": first + o.index,
                    "worker": o.worker,
                    "pd": o.pd,
                    "prefill_worker": o.prefill_worker,
                    "prompt_tokens": o.prompt_tokens,
                    "cached_tokens": o.cached_tokens,
                    "output_tokens": o.output_tokens,
                    "late_ms": round(o.late_s * 1000, 2),
                    "ttft_ms": ms[0],
                    "e2e_ms": ms[1],
                    "tpot_ms": ms[2],
                    "error": o.error,
                }
                f.write(json.dumps(line) + "\n")


class Progress:
    """On a terminal, ``policy [#####.....] done/total`` on stderr, redrawn every 1 %; elsewhere
    (a file, a pipe, CI's log) one plain line at each quarter, no carriage return (a redrawn
    bar there is kilobytes of ``\\r`` lines)."""

    def __init__(self, policy: str, total: int, stream: TextIO | None = None) -> None:
        self.policy, self.total, self.done = policy, total, 0
        self.stream = sys.stderr if stream is None else stream
        self._tty = self.stream.isatty()
        self._step = max(1, total // 100)

    def __call__(self, _: object = None) -> None:
        self.done += 1
        done, total = self.done, max(1, self.total)
        if not self._tty:
            if 4 * done // total > 4 * (done - 1) // total:  # a quarter reached
                print(f"{self.policy}: {done}/{self.total} requests done", file=self.stream,
                      flush=True)  # fmt: skip
        elif done % self._step == 0 or done == self.total:
            filled = 30 * done // total
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if done == self.total else ""
            print(f"\r{self.policy:>12} [{bar}] {done}/{self.total}", end=end,
                  file=self.stream, flush=True)  # fmt: skip
