"""Time per output token and goodput (kvrouter.replay.slo) against hand counts, and the row's
columns that carry them: the mean and p99 TPOT, requests per second meeting both objectives over
the run's span (simulated seconds in virtual time), and the share that met them."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvrouter.replay.fleet import EngineCounters
from kvrouter.replay.live_client import LiveOutcome
from kvrouter.replay.report import row, span_s
from kvrouter.replay.slo import Slo, good, goodput, tpot_s

SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def _out(
    ttft: float | None, e2e: float | None, tokens: int, error: str | None = None
) -> LiveOutcome:
    return LiveOutcome(0, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, prompt_tokens=100,
                       error=error)  # fmt: skip


def test_tpot_is_the_mean_gap_after_the_first_token() -> None:
    # 11 tokens: the first at 0.1 s, the other 10 over the next 1.0 s
    assert tpot_s(_out(0.1, 1.1, 11)) == pytest.approx(0.1)
    assert tpot_s(_out(0.2, 0.5, 4)) == pytest.approx(0.1)
    # no gap to measure: one token, no end, a failure
    assert tpot_s(_out(0.1, 0.1, 1)) is None
    assert tpot_s(_out(0.1, None, 5)) is None
    assert tpot_s(_out(0.1, 1.1, 11, error="HTTP 500")) is None


def test_a_request_is_good_only_when_it_meets_both_objectives() -> None:
    assert good(_out(0.5, 0.5 + 9 * 0.02, 10), SLO)  # TTFT 0.5 s, TPOT 20 ms
    assert not good(_out(1.5, 1.5 + 9 * 0.02, 10), SLO)  # TTFT over
    assert not good(_out(0.5, 0.5 + 9 * 0.06, 10), SLO)  # TPOT over
    assert good(_out(1.0, 1.0, 1), SLO)  # exactly on the TTFT line, no TPOT: it meets it
    assert not good(_out(0.5, None, 3), SLO)  # never finished
    assert not good(_out(None, None, 0, error="refused"), SLO)


def test_goodput_is_good_requests_per_second_of_the_span() -> None:
    outs = [
        _out(0.5, 0.5 + 9 * 0.02, 10),  # good
        _out(3.0, 3.5, 10),  # TTFT over
        _out(0.2, 0.2 + 9 * 0.1, 10),  # TPOT over
        _out(0.9, 0.9, 1),  # good (one token)
    ]
    assert goodput(outs, 2.0, SLO) == pytest.approx(1.0)  # 2 good over 2 s
    assert goodput(outs, 0.0, SLO) == 0.0
    with pytest.raises(ValueError):
        Slo(ttft_s=0.0, tpot_s=0.05)


@dataclass
class _Run:
    policy: str
    outcomes: list[LiveOutcome]
    engines: list[EngineCounters] = field(default_factory=list)
    sim_s: float | None = None
    wall_s: float = 0.0


def test_the_row_reports_tpot_and_goodput_over_simulated_time() -> None:
    outs = [
        _out(0.1, 0.1 + 10 * 0.01, 11),  # TPOT 10 ms, good
        _out(0.2, 0.2 + 10 * 0.03, 11),  # TPOT 30 ms, good
        _out(0.3, 0.3 + 2 * 0.09, 3),  # TPOT 90 ms: over
        _out(None, None, 0, error="HTTP 500"),  # counted in slo_% as not met
    ]
    # a virtual run: its rate is over the simulated 4 s, not the 100 s this machine took
    run = _Run("kvrouter", outs, sim_s=4.0, wall_s=100.0)
    assert span_s(run) == 4.0
    r = row(run, 0.5, None, SLO)
    assert r["tpot_mean_ms"] == pytest.approx((10 + 30 + 90) / 3, abs=0.05)
    assert r["tpot_p99_ms"] == pytest.approx(90.0)
    assert r["goodput_rps"] == pytest.approx(0.5)  # 2 good over 4 s
    assert r["slo_%"] == 50.0
    # a live run: its wall-clock span
    assert span_s(_Run("kvrouter", outs, wall_s=8.0)) == 8.0
    assert row(_Run("kvrouter", outs, wall_s=8.0), 0.5, None, SLO)["goodput_rps"] == 0.25
