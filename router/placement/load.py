"""The load ledger: the router's own accounting of load per worker rank, event-loop-only, no I/O.

A routed request counts on its worker from the moment it is placed:

- *in-flight prefill*: ``n − c(w)`` blocks (request blocks minus credited cached blocks) until its
  first token comes back (``first_token``);
- *active*: its blocks until it completes (``finish``). ``active_blocks`` counts distinct blocks —
  requests sharing a prefix share its KV blocks in a paged engine — plus one per request for its
  partial / decode block;
- *stall*: its stall weight until it completes — what a prefill on the worker costs it, as it
  decodes there during that prefill (:func:`router.placement.pd.stall_weight`: a short answer
  suffers most). Counted from the placement, not the first token: a request still prefilling,
  here or on a prefill worker, decodes here while a prefill placed now runs.

``shared(key, hashes)`` tells how many leading blocks of a new request are already active (and
being prefilled) on a worker: the scorer takes those off the load the request competes with.
Tickets are taken and closed by one owner, :class:`router.placement.flight.Flight`.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

from router.types import WorkerKey

__all__ = ["LoadLedger", "Ticket", "TicketState", "WorkerLoad"]


class TicketState(enum.IntEnum):
    """Where a ticket's request is: prefilling (counts as in-flight prefill and active), decoding
    (active only: its first token came back), or done (counts nowhere)."""

    PREFILL = 0
    DECODE = 1
    DONE = 2


class WorkerLoad:
    __slots__ = ("active", "inflight_prefill", "prefilling", "requests", "stall")

    def __init__(self) -> None:
        self.inflight_prefill = 0.0
        self.requests = 0
        self.stall = 0.0  # the stall weights of those requests (a prefill here stalls their steps)
        self.active: dict[int, int] = {}  # router hash -> refcount
        self.prefilling: dict[
            int, int
        ] = {}  # router hash -> refcount (uncached blocks being built)

    @property
    def active_blocks(self) -> int:
        return len(self.active) + self.requests


class Ticket:
    __slots__ = ("hashes", "id", "key", "prefill", "prefill_hashes", "state", "weight")

    def __init__(
        self,
        id: int,
        key: WorkerKey,
        hashes: Sequence[int],
        prefill: float,
        prefill_hashes: Sequence[int],
        weight: float = 1.0,
    ) -> None:
        self.id = id
        self.weight = weight
        self.key = key
        self.hashes = hashes
        self.prefill = prefill
        self.prefill_hashes = prefill_hashes
        self.state = TicketState.PREFILL


def _py_counts_add(d: dict[int, int], hashes: Sequence[int], delta: int) -> None:
    """Python twin of ``router._native.counts_add``."""
    for h in hashes:
        c = d.get(h, 0) + delta
        if c > 0:
            d[h] = c
        else:
            d.pop(h, None)


try:  # a proxied request adds and removes its ~10^2 blocks twice: in C, ~5x less time
    from router._native import counts_add as _counts_add
except ImportError:  # pragma: no cover - only where the extension could not be built
    _counts_add = _py_counts_add


def _inc(d: dict[int, int], hashes: Sequence[int]) -> None:
    _counts_add(d, hashes, 1)


def _dec(d: dict[int, int], hashes: Sequence[int]) -> None:
    _counts_add(d, hashes, -1)


class LoadLedger:
    """Every worker rank's load from the requests the router placed there (see the module
    docstring)."""

    def __init__(self) -> None:
        self._loads: dict[WorkerKey, WorkerLoad] = {}
        self._ids = itertools.count(1)

    def get(self, key: WorkerKey) -> WorkerLoad | None:
        return self._loads.get(key)

    def items(self) -> list[tuple[WorkerKey, WorkerLoad]]:
        return list(self._loads.items())

    def inflight(self, worker_id: str) -> int:
        return sum(ld.requests for k, ld in self._loads.items() if k[0] == worker_id)

    def shared(self, key: WorkerKey, hashes: Sequence[int]) -> tuple[int, int]:
        """``(leading blocks active on key, leading blocks being prefilled on key)``."""
        ld = self._loads.get(key)
        if ld is None or not ld.active or not hashes:
            return 0, 0
        active = ld.active
        building = ld.prefilling
        a = p = 0
        for h in hashes:
            if h not in active:
                break
            a += 1
            if h in building:
                p += 1
        return a, p

    def start(
        self,
        key: WorkerKey,
        hashes: Sequence[int],
        prefill: float,
        matched_blocks: int,
        weight: float = 1.0,
    ) -> Ticket:
        """Count a request placed on ``key``: ``prefill`` blocks to build, of which the blocks
        from ``matched_blocks`` on are not held anywhere on the worker yet; ``weight``: its
        stall weight."""
        ld = self._loads.get(key)
        if ld is None:
            ld = self._loads[key] = WorkerLoad()
        t = Ticket(next(self._ids), key, hashes, max(0.0, prefill), hashes[matched_blocks:], weight)
        ld.requests += 1
        ld.stall += weight
        ld.inflight_prefill += t.prefill
        _inc(ld.active, hashes)
        _inc(ld.prefilling, t.prefill_hashes)
        return t

    def first_token(self, t: Ticket) -> None:
        if t.state is not TicketState.PREFILL:
            return
        t.state = TicketState.DECODE
        ld = self._loads.get(t.key)
        if ld is None:
            return
        ld.inflight_prefill -= t.prefill
        if ld.inflight_prefill < 1e-9:
            ld.inflight_prefill = 0.0
        _dec(ld.prefilling, t.prefill_hashes)

    def finish(self, t: Ticket) -> None:
        if t.state is TicketState.DONE:
            return
        self.first_token(t)
        t.state = TicketState.DONE
        ld = self._loads.get(t.key)
        if ld is None:
            return
        ld.requests -= 1
        ld.stall -= t.weight
        if ld.stall < 1e-9:
            ld.stall = 0.0
        _dec(ld.active, t.hashes)
        if ld.requests <= 0 and not ld.active:
            del self._loads[t.key]

    def drop_worker(self, worker_id: str) -> None:
        for k in [k for k in self._loads if k[0] == worker_id]:
            del self._loads[k]
