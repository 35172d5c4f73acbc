"""The optional index cap (docs/architecture.md §3): at most ``max_entries`` (engine block,
worker) entries, the least recently matched going first.

Recency without writes on the request path: ``match`` appends the request's hashes to a bounded
record (``Matcher.recent``, which the cap turns on); the sweep, on the writer task, folds it into
marks on the blocks of each matched prefix. The sweep is a CLOCK over each worker's table
(insertion ordered, so the oldest store comes first): a marked entry gets a second chance (mark
cleared, moved to the back), an unmarked one is evicted, all its tiers at once. Marks stay until
the hand reaches them (at most ``max_entries`` of them: beyond, they start over). Workers take
turns, so a cap squeezes every worker alike. A sweep runs when the entries exceed the cap and
stops at 90 % of it, so it runs rarely; it is called by the subscriber task between rounds of
messages. Re-chunked workers' engine blocks are not evicted (a rare layout; their router blocks
count in ``len(index)``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from indexer.index.match import Matcher
from indexer.index.state import IndexState

__all__ = ["Evictor"]

#: Requests remembered between two rounds of the writer (each round folds them into marks);
#: small, as each holds its hash list.
RECENT_REQUESTS = 256


class Evictor:
    """The index's cap: ``set_cap`` and the writer's ``enforce_cap``. It owns the cap, the marks
    and the count of evictions; entries leave through ``IndexState.remove_tier``."""

    def __init__(self, state: IndexState, matcher: Matcher) -> None:
        self._state = state
        self._matcher = matcher
        #: At most this many (engine block, worker) entries; 0: no cap.
        self.max_entries = 0
        self.evicted_entries = 0
        #: The matcher's record of requests since the last sweep (only with a cap).
        self._recent: deque[Sequence[int]] | None = None
        #: Router hashes matched since the eviction hand last passed them.
        self._marked: set[int] = set()

    def set_cap(self, max_entries: int) -> None:
        """Cap the index at ``max_entries`` entries (0: no cap)."""
        if max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        self.max_entries = max_entries
        self._recent = deque(maxlen=RECENT_REQUESTS) if max_entries else None
        # a side record, not index state: ``match`` stays a read
        self._matcher.recent = self._recent
        self._marked.clear()

    def enforce_cap(self) -> int:
        """Fold the requests matched since the last call into marks, then, when over the cap,
        evict down to 90 % of it; returns the entries evicted. The writer calls it per round."""
        cap = self.max_entries
        if not cap:
            return 0
        state = self._state
        marked = self._marked
        present = state.present
        recent = self._recent
        while recent:
            for h in recent.popleft():
                if h not in present:
                    break  # the matched prefix ends where no worker holds a block
                marked.add(h)
        if len(marked) > cap:  # marks of blocks long gone: start over rather than grow
            marked.clear()
        workers = [w for w in state.by_key.values() if w.table]
        n = sum(len(w.table) for w in workers)
        if n <= cap:
            return 0
        target = cap - cap // 10
        evicted = 0
        chances = n  # second chances in this sweep; then the oldest go regardless
        i = 0
        while n > target and workers:
            w = workers[i % len(workers)]
            table = w.table
            if not table:
                workers.remove(w)
                continue
            i += 1
            e = next(iter(table))
            h = table[e]
            if chances and h in marked:
                chances -= 1
                marked.discard(h)  # its second chance, used (another worker's copy may go)
                del table[e]  # to the back: matched since the last sweep
                table[e] = h
                continue
            mask = w.emask.get(e, 1)
            w.dups.pop(e, None)
            t = 0
            while mask:
                if mask & 1:
                    state.remove_tier(w, e, t)
                mask >>= 1
                t += 1
            w.stats.evicted_entries += 1
            n -= 1
            evicted += 1
        self.evicted_entries += evicted
        return evicted
