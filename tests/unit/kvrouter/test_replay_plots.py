"""The replay's plots, rendered from a tiny virtual-time replay of every default policy: the
title names the mode, trace, slice and fleet; each bar shows its value; the slanted labels do not
overlap; kvrouter is set apart; the ideal and pooled-LRU lines are drawn, with the legend outside
the axes (over neither); the TTFT CDF marks each policy's p50 and p99. And ``--plots`` without
matplotlib fails before the run, in one line."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from kvrouter.replay.cli import VIRTUAL_DEFAULT, main
from kvrouter.replay.plots import KVROUTER_COLOR, hit_rate_figure, pd_sweep_figure, ttft_figure
from kvrouter.replay.report import row
from kvrouter.replay.trace import SharedPrefixSpec, TraceRequest, ideal_hit, pooled_lru_hit
from kvrouter.replay.trace import shared_prefix as make_shared_prefix
from kvrouter.replay.virtual import VirtualFleet, VirtualRun, run_virtual

ROOT = Path(__file__).resolve().parents[3]
TB = 64
CAPTION = "virtual: t.jsonl [0,36) 36 requests, 2 workers x 8,192 tokens"


@pytest.fixture(scope="module")
def replay() -> tuple[list[VirtualRun], list[dict[str, Any]], float, float]:
    spec = SharedPrefixSpec(groups=3, prompts=6, system_len=256, question_len=64, turns=2,
                            output_len=8, rate=20, think_s=0.5, seed=3)  # fmt: skip
    reqs: list[TraceRequest] = make_shared_prefix(spec, TB)
    fleet = VirtualFleet(workers=2, block_size=16, gpu_blocks=512)
    runs = [run_virtual(reqs, p, fleet, trace_block=TB) for p in VIRTUAL_DEFAULT.split(",")]
    ideal = ideal_hit(reqs, TB)
    pooled = pooled_lru_hit(reqs, TB, 2 * 512 * 16)
    return runs, [row(r, ideal, pooled) for r in runs], ideal, pooled


def _drawn(fig: Any) -> Any:
    FigureCanvasAgg(fig).draw()  # lays the text out: its extents are real
    return fig.axes[0]


def _overlap(a: Any, b: Any) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_the_hit_rate_bars_read_alone(replay) -> None:
    _, table, ideal, pooled = replay
    ax = _drawn(hit_rate_figure(table, ideal, pooled, CAPTION))
    assert CAPTION in ax.get_title() and "hit rate" in ax.get_title()
    values = {t.get_text() for t in ax.texts}
    assert values == {f"{r['hit_%']:.1f} %" for r in table}
    ticks = ax.get_xticklabels()
    assert [t.get_text() for t in ticks] == VIRTUAL_DEFAULT.split(",")
    boxes = [t.get_window_extent() for t in ticks]
    assert not any(_overlap(a, b) for a, b in itertools.combinations(boxes, 2))
    colors = {t.get_text(): bar.get_facecolor() for t, bar in zip(ticks, ax.patches)}
    mine = colors.pop("kvrouter")
    assert mine[:3] == pytest.approx(_rgb(KVROUTER_COLOR))
    assert all(c != mine for c in colors.values())
    lines = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines()}
    assert lines[f"infinite-cache ideal {ideal:.1%}"] == pytest.approx(ideal * 100)
    assert lines[f"one pooled LRU cache of the fleet's size {pooled:.1%}"] == pytest.approx(
        pooled * 100
    )
    legend = ax.get_legend().get_window_extent()
    assert not _overlap(legend, ax.get_window_extent())  # over no line, no bar


def _rgb(hex_color: str) -> tuple[float, ...]:
    return tuple(int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5))


def test_the_ttft_cdf_marks_p50_and_p99_and_sets_kvrouter_apart(replay) -> None:
    runs, table, _, _ = replay
    ax = _drawn(ttft_figure(runs, CAPTION))
    assert CAPTION in ax.get_title()
    curves = {
        line.get_label().split(":")[0]: line for line in ax.get_lines() if ":" in line.get_label()
    }
    assert list(curves) == VIRTUAL_DEFAULT.split(",")
    marks = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert len(marks) == len(runs)
    for r, mark in zip(table, marks):  # at the table's own p50 and p99
        assert list(mark.get_xdata()) == pytest.approx([r["ttft_p50_ms"], r["ttft_p99_ms"]], abs=1)
        assert list(mark.get_ydata()) == [0.5, 0.99]
        assert f"p50 {r['ttft_p50_ms']:,} ms" in curves[r["policy"]].get_label()
    widest = max(curves.values(), key=lambda line: line.get_linewidth())
    assert widest is curves["kvrouter"]
    assert not _overlap(ax.get_legend().get_window_extent(), ax.get_window_extent())


def _sweep_row(policy: str, goodput: float) -> dict[str, Any]:
    return {"policy": policy, "goodput_rps": goodput, "ttft_p99_ms": 3000, "tpot_p99_ms": 20}


@pytest.mark.parametrize("agg", [2.80, 2.90])
def test_the_pd_sweep_png_names_the_ratio_to_run_and_stars_it(agg: float) -> None:
    table = [_sweep_row("kvrouter 8 aggregated", agg), _sweep_row("kvrouter 2:6 cost", 2.81),
             _sweep_row("kvrouter 4:4 cost", 2.85), _sweep_row("kvrouter 4:4 always", 2.79)]  # fmt: skip
    fig = pd_sweep_figure(table, CAPTION)
    title = fig._suptitle.get_text()
    assert CAPTION in title
    stars = [line for line in fig.axes[0].get_lines() if line.get_marker() == "*"]
    labels = {line.get_label() for line in fig.axes[0].get_lines()}
    if agg < 2.85:  # a PD row wins: the title names its ratio and mode, its point is starred
        assert title.startswith("PD sweep: run 4:4 cost for this trace: goodput 2.85 req/s")
        assert [(s.get_xdata()[0], s.get_ydata()[0]) for s in stars] == [(4, 2.85)]
        assert {"kvrouter 8 aggregated", "cost", "always"} <= labels
    else:  # aggregated wins: said in the title and on its dashed line; no star
        assert title.startswith("PD sweep: run aggregated (kvrouter 8 aggregated, no PD)")
        assert stars == [] and "kvrouter 8 aggregated (recommended)" in labels


def test_the_cli_writes_both_pngs(tmp_path: Path, capsys) -> None:
    args = ["--workload", "shared-prefix", "--groups", "2", "--prompts", "3", "--system-len", "256"]
    args += ["--question-len", "64", "--trace-block", "64", "--workers", "2", "--gpu-blocks", "256"]
    args += ["--policies", "round_robin,kvrouter", "--no-progress", "--plots", str(tmp_path / "p")]
    assert main(args) == 0
    for name in ("ttft_cdf.png", "hit_rate.png"):
        assert (tmp_path / "p" / name).read_bytes()[:4] == b"\x89PNG"
    assert "plots:" in capsys.readouterr().out


def test_plots_without_matplotlib_fail_before_the_run_in_one_line(tmp_path: Path) -> None:
    # a Python where matplotlib cannot be imported (None in sys.modules: ImportError)
    code = "import sys; sys.modules['matplotlib'] = None; from kvrouter.cli import main; "
    code += "sys.exit(main(sys.argv[1:]))"
    argv = ["replay", "--workload", "shared-prefix", "--plots", str(tmp_path / "p")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "kvrouter replay: --plots needs matplotlib, which is not installed: "
        "pip install -e '.[replay]' (or pip install matplotlib)"
    ]  # no progress line: no policy ran
    assert done.stdout == "" and not (tmp_path / "p").exists()
