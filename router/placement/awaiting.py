"""Flights whose prefill the worker's KV events end (``Placer.fly(by_events=True)``): where the
router may see no answer byte that marks the prefill's end (an accounted ``/route``, the picker
seeing only the head), a flight waits on its rank until the rank's events show it built what
it had to (:meth:`AwaitingPrefills.blocks_stored`, after each batch applied). Split from the
placer, which owns one, as the idea of its own: who waits for which events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.placement.flight import Flight
from router.placement.load import Ticket
from router.types import WorkerKey

if TYPE_CHECKING:
    from indexer.index import PrefixIndex

__all__ = ["AwaitingPrefills"]

#: per worker rank, the flights at most whose prefill the events end
_MAX_AWAITING = 1024


class AwaitingPrefills:
    """Per worker rank, the flights whose prefill has not been seen to end, by ticket id."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._by_rank: dict[WorkerKey, dict[int, Flight]] = {}

    def wait(self, f: Flight) -> None:
        """Let rank's events end ``f``'s prefill. Its prefill is over once the rank holds what it
        builds (``built``); if it already does, there is nothing to see stored (a block predicted
        there is not held yet: a request with the same prompt may be building it). Past
        _MAX_AWAITING (accounted routes a caller never sent, say) a flight's prefill ends at its
        head or its end, as it did before the events did (an approximate rank has no events to
        end it: its head or its end does)."""
        t = f.ticket
        if t.hashes and not self.index.approximate(t.key) and not self.built(t):
            awaiting = self._by_rank.setdefault(t.key, {})
            if len(awaiting) < _MAX_AWAITING:
                f.awaiting = awaiting
                awaiting[t.id] = f

    def blocks_stored(self, key: WorkerKey) -> None:
        """Rank ``key``'s events were applied: a flight whose last block the rank now holds has
        finished its prefill there, whether or not its first byte was seen. So must the first
        block it had to build: past a hole in what the rank held, the last block may have been
        there all along."""
        awaiting = self._by_rank.get(key)
        if awaiting:
            for f in [f for f in awaiting.values() if self.built(f.ticket)]:
                f.prefill_over()

    def built(self, t: Ticket) -> bool:
        """The rank holds ``t``'s last block and the first it had to build."""
        holds, key = self.index.holds, t.key
        return holds(key, t.hashes[-1]) and (
            not t.prefill_hashes or holds(key, t.prefill_hashes[0])
        )

    def drop(self, key: WorkerKey) -> None:
        """The rank left (its flights end as their streams do)."""
        self._by_rank.pop(key, None)
