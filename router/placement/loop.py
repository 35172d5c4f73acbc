"""The closed loop (issue 36; docs/architecture.md §3): every answer that reports cached tokens is
judged against what the index predicted for its worker when the request was placed
(:mod:`router.placement.agreement`, the one judge ``kvrouter check`` uses too), one estimate per
worker. When a worker's reports turn disagreeing, the loop counts it, logs it once with the likely
cause, and scores that worker from its approximate tree alone (what the router sent it, which no
wrong event can spoil; for lost stores, ``worker_ahead``, seeded with what its events held, which
was true); once its recent answers agree again, those that turned it included (a return is a
fresh stream and, where the fault persists, another turn: measured on the replay, judging the
tree afresh sent a lossy worker back sooner and cost half a point of hit rate), and not before
its hold is over, it goes back to its events from a fresh stream. Other workers are untouched.

Pure like the rest of the core: the clock is injected, and the one write it makes — turning a
worker's ranks approximate or back — goes through :attr:`AgreementLoop.switch`, which the runtime
binds to ``Subscriber.set_source`` (the index's one writer asks the worker's replay endpoint for
a fresh stream on the way back, or rebuilds from its live events when it has none) and which is
the index itself where the caller's loop is its writer (the replay, the unit tests).

Why a hold that doubles: a fault that persists (events still lost) makes the approximate tree
agree, the events disagree again once back, and so on; each return waits twice as long as the
last, up to ``max_hold_s``, so such a worker spends nearly all its time on the tree that works.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.placement.agreement import WORKER_AHEAD, AgreementEstimator, Observation, Verdict
from router.placement.ports import NO_METRICS, PlacementMetrics
from router.settings.agreement import AgreementSettings
from router.types import WorkerKey

if TYPE_CHECKING:
    from indexer.index import PrefixIndex
    from indexer.index.types import RankRecord
    from router.placement.flight import Flight

__all__ = ["AgreementLoop", "observation"]

log = logging.getLogger("kvrouter.agreement")


def observation(
    f: Flight, engine_block_size: int = 0, stored: bool | None = None
) -> Observation | None:
    """What flight ``f`` predicted when it was placed against what its answer reported (and
    ``stored``: whether its worker's events showed the prompt's first block by then); None when
    the answer reported no cached tokens, or for the decode leg of a remote pick (its prompt's KV
    was transferred, not matched: its report says nothing of its own cache)."""
    if f.cached is None or f.leg == "decode" or f.block_size <= 0:
        return None
    return Observation(
        f.worker,
        f.prompt_tokens,
        f.block_size,
        f.by_tier,
        f.predicted_blocks,
        f.cached,
        engine_block_size,
        stored,
    )


class AgreementLoop:
    """Per-worker agreement of reports with the index, and the switch it drives; see the module
    docstring. Owned by :class:`router.placement.placer.Placer` (``placer.loop``)."""

    def __init__(
        self,
        settings: AgreementSettings,
        index: PrefixIndex,
        *,
        metrics: PlacementMetrics = NO_METRICS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.index = index
        self.metrics = metrics
        self.clock = clock
        self.estimator = AgreementEstimator(
            window=settings.window,
            window_s=settings.window_s,
            threshold=settings.threshold,
            ahead_threshold=settings.ahead_threshold,
            min_requests=settings.min_requests,
            clock=clock,
        )
        #: turns a worker rank approximate (True) or back to its events (False); the third
        #: argument keeps what its events hold as the seed of its tree (lost stores: they were
        #: true, only incomplete)
        self.switch: Callable[[WorkerKey, bool, bool], object] = index.set_approximate
        #: the workers the loop scores from their approximate tree: the verdict that turned
        #: them, and the earliest time they may go back
        self.turned: dict[str, tuple[Verdict, float]] = {}
        #: per worker, how many times it was turned (its next hold doubles)
        self.trips: dict[str, int] = {}
        #: per worker, the answers reporting cached tokens since it joined (the log says after
        #: how many of them a worker was named)
        self.answers: Counter[str] = Counter()

    def answered(self, f: Flight) -> None:
        """Flight ``f`` ended (``Flight.done``): judge its answer if it reported cached tokens."""
        if f.cached is None:
            return
        worker, key = f.worker, f.ticket.key
        self.answers[worker] += 1  # (the loop off too: the replay reports them)
        if not self.settings.enabled:
            return
        try:
            rec = self.index.worker(key)
        except KeyError:  # (it left meanwhile)
            return
        # a worker configured without events has nothing to go back to: nothing to switch
        if rec.approximate and worker not in self.turned:
            return
        obs = observation(f, rec.page, self._stored(f, rec))
        if obs is None:
            return
        v = self.estimator.observe(obs)
        if worker in self.turned:
            now = self.estimator.verdict(worker)
            if (
                self.clock() >= self.turned[worker][1]
                and now.agrees
                and now.requests >= self.settings.min_requests
            ):
                self._back(worker)
        elif v is not None and not v.agrees:
            self._turn(v)

    def stores(self, key: WorkerKey) -> int:
        """The stores rank ``key``'s events have made so far (-1: unknown, or approximate), for
        a flight placed there now (``Flight.stores``)."""
        try:
            rec = self.index.worker(key)
        except KeyError:
            return -1
        return -1 if rec.approximate else rec.stats.stored_events

    def _stored(self, f: Flight, rec: RankRecord) -> bool | None:
        """Whether the worker's events showed ``f``'s first block by its answer's end; None where
        they said nothing since it was placed (late, or a worker that stores nothing: no
        evidence either way). By then the worker computed the prompt and announced it: silence
        while it announces other stores is the one sign of a worker the router sends only new
        prefixes (a hash seed of its own: its events never match, nothing is predicted there).
        The first block: a page larger than a router block may leave the last partly stored."""
        hashes = f.ticket.hashes
        if not hashes or f.stores < 0 or rec.approximate or rec.stats.stored_events <= f.stores:
            return None
        return self.index.holds(f.ticket.key, hashes[0])

    def verdict(self, worker: str) -> dict[str, object]:
        """The worker's standing for ``GET /workers``: its estimate now, and whether the loop
        scores it from its approximate tree (``scoring``: ``events`` or ``approximate``)."""
        v = self.estimator.verdict(worker)
        turned = self.turned.get(worker)
        shown = turned[0] if turned is not None and v.agrees else v
        # a turned worker agrees once enough answers say so (not for want of any in its window)
        agrees = v.agrees and (turned is None or v.requests >= self.settings.min_requests)
        return {
            "agrees": agrees,
            "kind": shown.kind,
            "likely": shown.likely,
            "requests": v.requests,
            "counts": dict(v.counts),
            "scoring": "approximate" if turned is not None else "events",
        }

    def forget(self, worker: str) -> None:
        """The worker left: its estimate and its hold go with it."""
        self.estimator.forget(worker)
        self.turned.pop(worker, None)
        self.trips.pop(worker, None)
        self.answers.pop(worker, None)

    def _keys(self, worker: str) -> list[WorkerKey]:
        return [k for k in self.index.workers() if k[0] == worker]

    def _turn(self, v: Verdict) -> None:
        trips = self.trips[v.worker] = self.trips.get(v.worker, 0) + 1
        s = self.settings
        hold = min(s.max_hold_s, s.hold_s * 2 ** (trips - 1))
        self.turned[v.worker] = (v, self.clock() + hold)
        log.warning(
            "worker %s: its reported cached tokens disagree with the index (%s in %d of %d "
            "answers, its answer %d): likely %s; scored from what the router sent it until they "
            "agree again",
            v.worker,
            v.kind,
            v.disagreeing,
            v.requests,
            self.answers[v.worker],
            v.likely,
        )
        self.metrics.agreement(v.worker, v.kind, True)
        # the worker reports more than its events say: what they say is true (stores lost),
        # so its tree starts from it; the index claiming more than the worker reuses is the
        # opposite, and its entries go (they are what is wrong)
        keep = v.kind == WORKER_AHEAD
        for key in self._keys(v.worker):
            self.switch(key, True, keep)

    def _back(self, worker: str) -> None:
        v, _ = self.turned.pop(worker)
        log.info("worker %s: its reports agree again: back to its events", worker)
        self.metrics.agreement(worker, v.kind, False)
        # the events are judged afresh: the approximate tree's answers say nothing of them
        self.estimator.forget(worker)
        for key in self._keys(worker):
            self.switch(key, False, False)
