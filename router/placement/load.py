"""The load ledger: the router's own accounting of load per worker rank, event-loop-only, no I/O.

A routed request counts on its worker from the moment it is placed:

- *in-flight prefill*: ``n − c(w)`` blocks (request blocks minus credited cached blocks) until its
  first token comes back (``first_token``);
- *active*: its blocks until it completes (``finish``). ``active_blocks`` counts distinct blocks —
  requests sharing a prefix share its KV blocks in a paged engine — plus one per request for its
  partial / decode block.

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
    __slots__ = ("active", "decoding", "inflight_prefill", "prefilling", "requests")

    def __init__(self) -> None:
        self.inflight_prefill = 0.0
        self.requests = 0
        self.decoding = 0  # of those, past their first token (a prefill here stalls their steps)
        self.active: dict[int, int] = {}  # router hash -> refcount
        self.prefilling: dict[
            int, int
        ] = {}  # router hash -> refcount (uncached blocks being built)

    @property
    def active_blocks(self) -> int:
        return len(self.active) + self.requests


class Ticket:
    __slots__ = ("hashes", "id", "key", "prefill", "prefill_hashes", "state")

    def __init__(
        self,
        id: int,
        key: WorkerKey,
        hashes: Sequence[int],
        prefill: float,
        prefill_hashes: Sequence[int],
    ) -> None:
        self.id = id
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
        self, key: WorkerKey, hashes: Sequence[int], prefill: float, matched_blocks: int
    ) -> Ticket:
        """Count a request placed on ``key``: ``prefill`` blocks to build, of which the blocks
        from ``matched_blocks`` on are not held anywhere on the worker yet."""
        ld = self._loads.get(key)
        if ld is None:
            ld = self._loads[key] = WorkerLoad()
        t = Ticket(next(self._ids), key, hashes, max(0.0, prefill), hashes[matched_blocks:])
        ld.requests += 1
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
        ld.decoding += 1
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
        ld.decoding -= 1
        _dec(ld.active, t.hashes)
        if ld.requests <= 0 and not ld.active:
            del self._loads[t.key]

    def drop_worker(self, worker_id: str) -> None:
        for k in [k for k in self._loads if k[0] == worker_id]:
            del self._loads[k]
