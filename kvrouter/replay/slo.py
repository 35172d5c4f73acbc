"""Time per output token and goodput: what a request's latency means to its user, per request.

* **TPOT** (time per output token) of one request: ``(e2e − ttft) / (output tokens − 1)``, the
  mean gap between the tokens after the first, as vLLM's ``benchmark_serving`` computes it; none
  for a request with fewer than two output tokens (it has no gap) or one that failed. A prefill
  that lands in the step of a decoding request stretches that step, so it shows here, where TTFT
  does not see it.
* **goodput**: requests per second that met *both* objectives (TTFT ≤ ``ttft_s`` and TPOT ≤
  ``tpot_s``; a request without a TPOT meets that one by having none), over the run's span (the
  first arrival to the last completion). Throughput counts every answer; goodput only those a
  user would call served in time (DistServe's measure, and what splitting prefill from decode
  is meant to raise).

Times are what the table reports: simulated seconds in virtual time, wall-clock seconds live
(there from the streamed answer: its first text chunk and its end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrouter.replay.live_client import LiveOutcome

__all__ = ["DEFAULT_SLO", "Slo", "good", "goodput", "missed", "tpot_s"]


@dataclass(frozen=True)
class Slo:
    """The two objectives, in seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("the TTFT and TPOT objectives must be positive")


#: the defaults of ``--slo-ttft-ms`` and ``--slo-tpot-ms``: a chat user's patience for the first
#: token (2 s), and a stream read comfortably faster than one reads (50 ms a token, 20 tokens/s)
DEFAULT_SLO = Slo(ttft_s=2.0, tpot_s=0.05)


def tpot_s(o: LiveOutcome) -> float | None:
    """The request's time per output token (see the module docstring), or None."""
    if o.error is not None or o.ttft_s is None or o.e2e_s is None or o.output_tokens < 2:
        return None
    return max(0.0, o.e2e_s - o.ttft_s) / (o.output_tokens - 1)


def missed(o: LiveOutcome, slo: Slo) -> str | None:
    """What a request missed: ``"error"`` (no answer), ``"ttft"``, ``"tpot"``; None when it met
    both objectives."""
    if o.error is not None or o.ttft_s is None or o.e2e_s is None:
        return "error"
    if o.ttft_s > slo.ttft_s:
        return "ttft"
    t = tpot_s(o)
    return None if t is None or t <= slo.tpot_s else "tpot"


def good(o: LiveOutcome, slo: Slo) -> bool:
    """Whether a request was answered and met both objectives."""
    return missed(o, slo) is None


def goodput(outcomes: Sequence[LiveOutcome], span_s: float, slo: Slo) -> float:
    """Requests per second meeting both objectives over ``span_s`` (0 when the span is)."""
    if span_s <= 0:
        return 0.0
    return sum(1 for o in outcomes if good(o, slo)) / span_s
