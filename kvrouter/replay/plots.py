"""What a replay draws (``--plots DIR``): ``hit_rate.png`` and ``ttft_cdf.png``, made to be read
by someone who did not run the replay; with ``--pd-sweep`` also ``pd_sweep.png``: goodput, TTFT
p99 and TPOT p99 against the P:D ratio, one line per mode, the aggregated fleet as a dashed line,
the recommended row starred.

Both carry a title naming the mode, the trace and its slice, and the fleet. ``hit_rate.png``: one
bar per policy with its value on it, the infinite-cache ideal and one pooled LRU cache of the
fleet's size as lines, kvrouter's bars in their own colour; the labels slanted so seven or more do
not overlap. ``ttft_cdf.png``: one curve per policy on a log time axis, each with its p50 and
p99 marked, kvrouter's drawn thicker and on top. Legends sit outside the axes, over no line.

matplotlib is the ``replay`` extra's (``pip install -e '.[replay]'``), imported only to draw:
:func:`check_plotting` tells at argument time, before a run of minutes, whether it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrouter.replay.report import Run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "check_plotting",
    "hit_rate_figure",
    "is_kvrouter",
    "pd_sweep_figure",
    "plot",
    "plot_pd_sweep",
    "ttft_figure",
]

#: kvrouter's colour; the other policies take the qualitative palette in order, without it
KVROUTER_COLOR = "#d62728"
_OTHERS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
_STYLES = ["-", "--", "-.", ":"]
#: the other policies' bars: one muted colour, so kvrouter's stands out
_PEERS = "#7f9fbf"


def check_plotting() -> None:
    """:class:`ValueError` saying how to get matplotlib when it cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "--plots needs matplotlib, which is not installed: pip install -e '.[replay]' "
            "(or pip install matplotlib)"
        ) from e


def is_kvrouter(policy: str) -> bool:
    """The router's own rows: kvrouter, kvrouter-epp, 'kvrouter (N processes)', ..."""
    return policy.startswith("kvrouter")


def _colors(policies: Sequence[str]) -> list[str]:
    others = iter(_OTHERS * (1 + len(policies) // len(_OTHERS)))
    return [KVROUTER_COLOR if is_kvrouter(p) else next(others) for p in policies]


def _pct(xs: Sequence[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]  # (as the table's p50 and p99)


def hit_rate_figure(
    table: Sequence[dict[str, Any]], ideal: float, pooled: float | None, caption: str
) -> Figure:
    from matplotlib.figure import Figure

    policies = [str(r["policy"]) for r in table]
    hits = [float(r["hit_%"]) for r in table]
    fig = Figure(figsize=(max(7.0, 1.0 * len(policies) + 3), 4.5))
    ax = fig.add_subplot()
    colors = [KVROUTER_COLOR if is_kvrouter(p) else _PEERS for p in policies]
    bars = ax.bar(policies, hits, color=colors)
    # inside the bars: a value above one would sit on the ideal or LRU line near its top
    ax.bar_label(bars, labels=[f"{h:.1f} %" for h in hits], label_type="center", fontsize=9,
                 color="white", fontweight="bold")  # fmt: skip
    ax.axhline(
        ideal * 100, linestyle="--", color="black", label=f"infinite-cache ideal {ideal:.1%}"
    )
    if pooled is not None:
        label = f"one pooled LRU cache of the fleet's size {pooled:.1%}"
        ax.axhline(pooled * 100, linestyle=":", color="dimgray", label=label)
    ax.set_ylim(0, max([ideal * 100, *hits, 1.0]) * 1.15)  # room for the values over the bars
    ax.set_ylabel("prefix hit (% of prompt tokens)")
    ax.tick_params(axis="x", labelrotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
        label.set_rotation_mode("anchor")
        if is_kvrouter(label.get_text()):
            label.set_fontweight("bold")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(f"Prefix hit rate per policy\n{caption}", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def _leading(v: float) -> bool:
    """Whether a minor tick of a log axis is labelled: 2 and 5 of each decade (the rest crowd)."""
    digits = f"{v:.0e}"
    return digits[0] in "25"


def ttft_figure(runs: Sequence[Run], caption: str) -> Figure:
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(9, 5))
    ax = fig.add_subplot()
    policies = [r.policy for r in runs]
    for i, (run, color) in enumerate(zip(runs, _colors(policies))):
        s = sorted(o.ttft_s * 1000 for o in run.outcomes if o.ttft_s is not None)
        if not s:
            continue
        mine = is_kvrouter(run.policy)
        p50, p99 = _pct(s, 0.5), _pct(s, 0.99)
        ax.plot(
            s,
            [k / len(s) for k in range(len(s))],
            color=color,
            linestyle="-" if mine else _STYLES[i % len(_STYLES)],
            linewidth=2.5 if mine else 1.2,
            zorder=3 if mine else 2,
            label=f"{run.policy}: p50 {p50:,.0f} ms, p99 {p99:,.0f} ms",
        )
        ax.plot([p50, p99], [0.5, 0.99], linestyle="none", marker="o", color=color, zorder=4)
    for q in (0.5, 0.99):  # (left, inside: the curves reach these fractions further right)
        ax.axhline(q, color="gray", linewidth=0.6, alpha=0.6, zorder=1)
        ax.annotate(f"p{q * 100:.0f}", (0, q), xycoords=("axes fraction", "data"),
                    xytext=(3, 2), textcoords="offset points", fontsize=8, color="gray")  # fmt: skip
    ax.set_xscale("log")
    ms = FuncFormatter(lambda v, _: f"{v:,.0f}")  # 20, not 2 x 10^1
    ax.xaxis.set_major_formatter(ms)
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if _leading(v) else ""))
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Time to first token, CDF per policy (dots: p50, p99)\n{caption}", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def plot(
    out: Path,
    runs: Sequence[Run],
    table: Sequence[dict[str, Any]],
    ideal: float,
    pooled: float | None = None,
    caption: str = "",
) -> list[Path]:
    """``ttft_cdf.png`` and ``hit_rate.png`` under ``out``; ``caption``: the mode, trace, slice
    and fleet, under each title."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "ttft_cdf.png", out / "hit_rate.png"]
    figures = [ttft_figure(runs, caption), hit_rate_figure(table, ideal, pooled, caption)]
    for path, fig in zip(paths, figures):
        fig.savefig(path, dpi=120, bbox_inches="tight")  # (the outside legends included)
    return paths


_PANELS = (("goodput_rps", "goodput (req/s)"), ("ttft_p99_ms", "TTFT p99 (ms)"),
           ("tpot_p99_ms", "TPOT p99 (ms)"))  # fmt: skip


def pd_sweep_figure(table: Sequence[dict[str, Any]], caption: str) -> Figure:
    from matplotlib.figure import Figure

    from kvrouter.replay.pd_sweep import best_row, ratio_mode_of, recommend

    lines: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
    baseline = None
    for r in table:
        label = ratio_mode_of(str(r["policy"]))
        if label is None:
            baseline = r
        else:
            ratio, mode = label
            lines.setdefault(mode, []).append((int(ratio.split(":")[0]), ratio, r))
    best, chosen = recommend(table), best_row(table)
    fig = Figure(figsize=(14, 4.2))
    axes = fig.subplots(1, len(_PANELS))
    for ax, (key, name) in zip(axes, _PANELS):
        for k, (mode, pts) in enumerate(sorted(lines.items())):
            pts.sort(key=lambda t: t[0])
            xs = [p for p, _, _ in pts]
            ys = [r.get(key) or 0 for _, _, r in pts]
            ax.plot(xs, ys, marker="o", color=_OTHERS[k % len(_OTHERS)], label=mode,
                    linestyle=_STYLES[k % len(_STYLES)])  # fmt: skip
            for x, (_, _, r) in zip(xs, pts):
                if r is chosen:
                    ax.plot([x], [r.get(key) or 0], marker="*", markersize=16,
                            color=KVROUTER_COLOR, zorder=5)  # fmt: skip
            ax.set_xticks(xs, [lab for _, lab, _ in pts])
        if baseline is not None and baseline.get(key) is not None:
            run = " (recommended)" if baseline is chosen else ""  # (no star on a dashed line)
            base_label = f"{baseline['policy']}{run}"
            ax.axhline(baseline[key], linestyle="--", color="black", label=base_label)
        ax.set_xlabel("prefill : decode engines")
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8, frameon=False)
    fig.suptitle(f"PD sweep: {best} (star)\n{caption}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_pd_sweep(out: Path, table: Sequence[dict[str, Any]], caption: str = "") -> Path:
    """``pd_sweep.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pd_sweep.png"
    pd_sweep_figure(table, caption).savefig(path, dpi=120, bbox_inches="tight")
    return path
