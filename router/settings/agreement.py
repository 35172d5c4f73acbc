"""Settings of the closed loop (``agreement:``, issue 36, docs/architecture.md §3): how the router
judges each worker's reported cached tokens against the index's prediction
(:class:`router.placement.agreement.AgreementEstimator`) and how long a worker whose events went
wrong is scored from its approximate tree. Part of :class:`router.settings.Settings`, kept here
so each module stays small."""

from __future__ import annotations

import msgspec

from router.errors import config_check as _check

__all__ = ["AgreementSettings"]


class AgreementSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The loop is on by default: it only acts on answers that report ``cached_tokens``."""

    enabled: bool = True
    #: the informative answers per worker the estimate rests on, and how old they may be
    window: int = 64
    window_s: float = 600.0
    #: the disagreeing share that turns a worker (it agrees again at half of it)
    threshold: float = 0.5
    #: the ``worker_ahead`` answers (the worker reports hits the index never predicted: lost
    #: stores) in a full window that turn a worker, as a share of ``window``: lower, as such a
    #: fault hides most of its evidence and right events give none (``AgreementEstimator``)
    ahead_threshold: float = 0.1
    #: answers in the window before a worker can be judged at all
    min_requests: int = 8
    #: a worker turned approximate stays so at least this long before its events are trusted
    #: again, doubled each time it turns again (a fault that persists does not flap), up to
    #: ``max_hold_s``
    hold_s: float = 30.0
    max_hold_s: float = 1800.0

    def __post_init__(self) -> None:
        _check(self.window >= 1, "window", "must be >= 1")
        _check(self.window_s > 0, "window_s", "must be > 0")
        _check(0 < self.threshold <= 1, "threshold", "must be in (0, 1]")
        _check(0 < self.ahead_threshold <= 1, "ahead_threshold", "must be in (0, 1]")
        _check(self.min_requests >= 1, "min_requests", "must be >= 1")
        _check(self.hold_s >= 0, "hold_s", "must be >= 0")
        _check(self.max_hold_s >= self.hold_s, "max_hold_s", "must be >= hold_s")
