"""Does a worker's cache agree with the index? One answer compared (:func:`compare`), and a
per-worker estimate over many (:class:`AgreementEstimator`). Pure: no I/O, the clock injected.
``kvrouter check`` (two probes, the second compared) and the closed loop (issue 36: every answer
that reports cached tokens) both judge with this module, so they name a problem the same way.

An :class:`Observation` is what was known when a request was placed on a worker — the blocks of
its prompt the index held there per tier (the worker's own events said so), the blocks the
router only predicted there (it routed their prefix there moments ago), the prompt's length and
the router's block size — and what the worker's answer then reported reused
(``usage.prompt_tokens_details.cached_tokens``). Engines reuse whole blocks only and always
compute the last prompt token (:func:`reusable_tokens`); vLLM reports cached tokens rounded to
its own block size, so a report within one engine block of the prediction agrees.

The shape of a disagreement tells the likely cause (:data:`CAUSES`):

- ``index_ahead``: the index predicts hits the worker never reports: removals lost, the worker
  restarted silently (its cache is empty, the index still full), or its tokenizer, block size or
  hash seed differ from the router's (the router's own predictions then never come true);
- ``worker_ahead``: the worker reports hits the index never predicted: stores lost, or a
  different tokenizer or hash seed (its events store blocks the router never matches). Also an
  answer that agrees but whose prompt's first block the worker's events never showed by its end
  (``Observation.stored``): the worker computed the prompt, so it holds it, and a router that
  sends it only new prefixes (its events never match, so nothing is predicted there) would
  otherwise see nothing but ``no_signal``.

A caller that wants the events' word alone (``kvrouter check``: the router's own prediction from
a first probe is no evidence) passes ``predicted_blocks=0``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "AGREE",
    "CAUSES",
    "INDEX_AHEAD",
    "KINDS",
    "NO_SIGNAL",
    "WORKER_AHEAD",
    "AgreementEstimator",
    "Comparison",
    "Observation",
    "Verdict",
    "compare",
    "reusable_tokens",
]

AGREE = "agree"
INDEX_AHEAD = "index_ahead"
WORKER_AHEAD = "worker_ahead"
#: nothing predicted and nothing reported: says nothing either way (a new prefix, a short prompt)
NO_SIGNAL = "no_signal"
#: every kind, in a fixed order (a metric's reason label takes the disagreeing two)
KINDS = (AGREE, INDEX_AHEAD, WORKER_AHEAD, NO_SIGNAL)

#: the likely causes of each disagreement, as a log line or ``kvrouter check`` names them
CAUSES = {
    INDEX_AHEAD: "lost removals, a silent restart, or a different tokenizer, block size or "
    "hash seed",
    WORKER_AHEAD: "lost stores, or a different tokenizer or hash seed",
}
# Sharper where the shape says more: the index held none of the prompt from the worker's events,
# yet the worker reports hits, or the prediction rested on the router's guesses alone.
_NEVER_MATCHED = (
    "its events never matched this prompt: a different tokenizer, block size or hash seed, "
    "or lost stores"
)
_NEVER_CONFIRMED = (
    "the blocks were predicted, never confirmed by its events, and not reused: a different "
    "tokenizer, block size or hash seed, or prefix caching off"
)
_NOTHING_REUSED = "it reuses nothing: a silent restart, or prefix caching off"
_NEVER_STORED = (
    "its events never showed the blocks it was sent: a different tokenizer, block size or "
    "hash seed, lost stores, or prefix caching off"
)


def reusable_tokens(blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens a worker holding the first ``blocks`` blocks reuses: whole blocks, never the
    last prompt token (vLLM and the bundled engine always compute it), so a prompt of exactly k
    blocks reuses at most k - 1 of them."""
    return min(blocks, max(0, prompt_tokens - 1) // block_size) * block_size


@dataclass(frozen=True)
class Observation:
    """One answer's evidence. ``by_tier``: the prompt's leading blocks the index held on the worker
    when it was placed, per tier (from its events); ``predicted_blocks``: the blocks after those
    that the router only predicted there (the placement's overlay); ``prompt_tokens``: the
    prompt's length in the router's tokens; ``block_size``: the router's; ``reported_tokens``: the
    worker's ``cached_tokens``; ``engine_block_size``: the worker's page size when known (its
    reports are rounded to it), 0 otherwise; ``stored``: whether the worker's events showed the
    prompt's first block by the answer's end (None: not asked, as for an approximate rank)."""

    worker: str
    prompt_tokens: int
    block_size: int
    by_tier: Mapping[str, int]
    predicted_blocks: int
    reported_tokens: int
    engine_block_size: int = 0
    stored: bool | None = None

    @property
    def confirmed_blocks(self) -> int:
        return sum(self.by_tier.values())


@dataclass(frozen=True)
class Comparison:
    """One observation judged: its ``kind`` (:data:`KINDS`), the tokens the placement predicted
    reused (``expected``; of them ``confirmed`` by the worker's events), the tokens the worker
    reported, and the likely cause of a disagreement ("" when it agrees)."""

    worker: str
    kind: str
    expected: int
    confirmed: int
    reported: int
    likely: str = ""

    @property
    def agrees(self) -> bool:
        return self.kind in (AGREE, NO_SIGNAL)


def compare(obs: Observation) -> Comparison:
    """Judge one observation; see the module docstring."""
    if obs.block_size <= 0:
        raise ValueError("block_size must be positive")
    confirmed = reusable_tokens(obs.confirmed_blocks, obs.prompt_tokens, obs.block_size)
    blocks = obs.confirmed_blocks + obs.predicted_blocks
    expected = reusable_tokens(blocks, obs.prompt_tokens, obs.block_size)
    reported = obs.reported_tokens
    # a report is rounded to the engine's block: closer than one of those is agreement
    slack = max(obs.block_size, obs.engine_block_size)
    if expected == 0 and reported == 0:
        kind, likely = NO_SIGNAL, ""
    elif abs(reported - expected) < slack:
        kind, likely = AGREE, ""
    elif reported < expected:
        kind = INDEX_AHEAD
        if reported == 0 and confirmed >= slack:
            likely = _NOTHING_REUSED
        elif confirmed <= reported:
            likely = _NEVER_CONFIRMED
        else:
            likely = CAUSES[INDEX_AHEAD]
    else:
        kind = WORKER_AHEAD
        likely = _NEVER_MATCHED if confirmed == 0 else CAUSES[WORKER_AHEAD]
    if obs.stored is False and kind in (AGREE, NO_SIGNAL):
        kind, likely = WORKER_AHEAD, _NEVER_STORED
    return Comparison(obs.worker, kind, expected, confirmed, reported, likely)


@dataclass(frozen=True)
class Verdict:
    """A worker's standing: ``agrees`` (False: its reports disagree beyond the threshold), the
    dominant disagreement (``kind``, "" when it agrees) and its likely cause, and the counts of
    the informative requests in the window it rests on (``counts`` by kind, ``requests`` their
    sum)."""

    worker: str
    agrees: bool
    kind: str
    likely: str
    requests: int
    counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def disagreeing(self) -> int:
        return self.counts.get(INDEX_AHEAD, 0) + self.counts.get(WORKER_AHEAD, 0)


class AgreementEstimator:
    """Per-worker agreement over a window: the last ``window`` informative answers (those with
    anything predicted or reported: a new prefix says nothing), none older than ``window_s``.
    A worker turns disagreeing once at least ``min_requests`` of them are in its window and the
    disagreeing share reaches ``threshold``, or its ``worker_ahead`` answers reach
    ``ahead_threshold`` of a full window; it agrees again once that share falls to half its line
    (hysteresis: a worker near the line does not flap). :meth:`observe` answers the new
    :class:`Verdict` only when the standing changed, so the caller logs each change once.

    Why a second, lower line for ``worker_ahead``: lost stores hide most of their own evidence.
    The router sends a prefix whose store it lost elsewhere (nothing says the worker holds it),
    so only the requests placed there for other reasons report it; and events that are right
    give no ``worker_ahead`` at all (the index and its predictions hold every block sent, and
    the rank's cap is above its capacity), so a few in a window are a fault. Counted against a
    full window, not the answers seen so far, so one early answer does not turn a worker.
    """

    def __init__(
        self,
        *,
        window: int = 64,
        window_s: float = 600.0,
        threshold: float = 0.5,
        ahead_threshold: float | None = None,
        min_requests: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        ahead = threshold if ahead_threshold is None else ahead_threshold
        if window < 1 or min_requests < 1 or not (0.0 < threshold <= 1.0 and 0.0 < ahead <= 1.0):
            raise ValueError(
                "window and min_requests must be >= 1, threshold and ahead_threshold in (0, 1]"
            )
        self.window = window
        self.window_s = window_s
        self.threshold = threshold
        self.ahead_threshold = ahead
        self.min_requests = min(min_requests, window)
        self._clock = clock
        self._seen: dict[str, deque[tuple[float, Comparison]]] = {}
        self._disagreeing: dict[str, bool] = {}

    def observe(self, obs: Observation) -> Verdict | None:
        """Count one answer; the worker's new verdict if its standing changed, else None."""
        c = compare(obs)
        if c.kind == NO_SIGNAL:
            return None
        seen = self._seen.get(obs.worker)
        if seen is None:
            seen = self._seen[obs.worker] = deque(maxlen=self.window)
        seen.append((self._clock(), c))
        v = self.verdict(obs.worker)
        now, was = not v.agrees, self._disagreeing.get(obs.worker, False)
        if now == was:
            return None
        self._disagreeing[obs.worker] = now
        return v

    def verdict(self, worker: str) -> Verdict:
        """The worker's standing now (a worker never observed agrees)."""
        seen = self._seen.get(worker)
        if seen is not None:
            cutoff = self._clock() - self.window_s
            while seen and seen[0][0] < cutoff:
                seen.popleft()
        comps = [c for _, c in seen or ()]
        counts = {k: 0 for k in KINDS if k != NO_SIGNAL}
        for c in comps:
            counts[c.kind] += 1
        n = len(comps)
        bad = counts[INDEX_AHEAD] + counts[WORKER_AHEAD]
        ahead = counts[WORKER_AHEAD]
        half = 0.5 if self._disagreeing.get(worker, False) else 1.0
        by_share = bad > 0 and bad / max(n, 1) >= self.threshold * half
        by_ahead = ahead > 0 and ahead / self.window >= self.ahead_threshold * half
        if n < self.min_requests or not (by_share or by_ahead):
            return Verdict(worker, True, "", "", n, counts)
        if by_share:
            kind = INDEX_AHEAD if counts[INDEX_AHEAD] >= counts[WORKER_AHEAD] else WORKER_AHEAD
        else:
            kind = WORKER_AHEAD
        # the likely cause the most frequent among this kind's comparisons names
        causes: dict[str, int] = {}
        for c in comps:
            if c.kind == kind:
                causes[c.likely] = causes.get(c.likely, 0) + 1
        likely = max(causes, key=lambda k: causes[k])
        return Verdict(worker, False, kind, likely, n, counts)

    def forget(self, worker: str) -> None:
        """The worker left, or its index was rebuilt: start its estimate afresh."""
        self._seen.pop(worker, None)
        self._disagreeing.pop(worker, None)

    def workers(self) -> list[str]:
        return sorted(self._seen)
