"""The index's caps (docs/architecture.md §3): its memory is bounded twice over.

- Per worker rank: a worker cannot hold more blocks than its KV cache has, so the index holds at
  most its cap of (engine block) entries for it: its capacity (engine blocks of the tiers the
  worker reported, ``set_rank_capacity``) times ``margin``, else ``rank_default``. A rank that
  holds blocks on a tier whose size it did not report gets at least the default. Past its cap a
  worker is wrong or hostile: only its own least recently used entries go (counted in its
  ``rank_evicted_entries``, warned about once), and nothing else waits for it. The applier asks
  after each batch of the rank (one comparison, ``RankRecord.cap``), so a rank never holds more
  than its cap plus one batch.
- Globally (``max_entries``): every rank's entries together; over it, ranks give up alike,
  least recently used first (``evicted_entries``). The writer asks between rounds of messages.

Recency without writes on the request path: ``match`` appends the request's hashes to a bounded
record (``Matcher.recent``, on while a cap is); while a rank (or the index) is near its cap
(past 80 % of it: a worker's capacity, with the default margin), the writer folds the record
into marks each round (router hash -> the slots holding it when it was matched), and otherwise
keeps only its last few requests: well-behaved workers stay under their capacity and cost the
request path nothing more. A sweep is a CLOCK over a rank's table (insertion ordered, so the
oldest store comes first): an entry marked for the rank gets a second chance (the mark
cleared, moved to the back), an unmarked one is evicted, all its tiers at once. Least recently
used is thus least recently stored or matched. A sweep stops ``slack`` under the cap (a tenth
of it, at most ``EVICT_SLACK`` entries: a few milliseconds a sweep), so it runs rarely.
Re-chunked ranks' engine blocks go the same way, marked through the router blocks they cover.
The global cap reads a running total of entries the applier keeps batch by batch, and counts
exactly (every rank) only past it.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from itertools import islice

from indexer.events import CANONICAL_TIERS, EngineHash
from indexer.index.approx import trim as approx_trim
from indexer.index.match import Matcher
from indexer.index.native import remove_gpu
from indexer.index.state import IndexState
from indexer.index.types import GPU, MAX_TIERS, RankRecord

__all__ = ["EVICT_SLACK", "Evictor"]

log = logging.getLogger("kvrouter.index")

#: Requests remembered between two rounds of the writer (each round folds them into marks);
#: small, as each holds its hash list.
RECENT_REQUESTS = 256
#: A sweep evicts down to this many entries under the cap at most (a tenth of it when smaller).
EVICT_SLACK = 8192
#: Requests the record keeps while no cap is near (the ones a rank nearing its cap folds first).
IDLE_RECENT = 16


def _slack(cap: int) -> int:
    return min(cap // 10, EVICT_SLACK)


def _near(cap: int) -> int:
    """Entries past which a rank (or the index) is near ``cap``: from there matches count."""
    return cap - cap // 5


class Evictor:
    """The index's caps; see the module docstring. Entries leave through the state's
    ``remove_tier`` (or the C twin of its GPU path) and the re-chunk table's ``evict``."""

    def __init__(self, state: IndexState, matcher: Matcher) -> None:
        self._state = state
        self._matcher = matcher
        #: At most this many entries in all (0: no global cap); evicted by it so far.
        self.max_entries = 0
        self.evicted_entries = 0
        #: The cap of a rank whose capacity is not known (0: none), and the capacity's margin.
        self.rank_default = 0
        self.margin = 1.0
        #: The matcher's record of requests since the last fold (only while a cap is on).
        self._recent: deque[Sequence[int]] | None = None
        #: Router hash -> slots whose entry of it was matched since their sweep last passed it.
        self._marked: dict[int, int] = {}
        #: Ranks near their cap (their matches are folded into marks every round).
        self._hot: set[RankRecord] = set()

    # ---------------------------------------------------------------- settings

    def set_cap(self, max_entries: int) -> None:
        """Cap the index at ``max_entries`` entries (0: no global cap)."""
        if max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        self.max_entries = max_entries
        self._recount()
        self._sync_recent()

    def set_rank_caps(self, default: int, margin: float) -> None:
        """Each rank's cap: its capacity times ``margin`` when known, else ``default`` (0: none)."""
        if default < 0 or not margin > 0:
            raise ValueError("the default cap must be >= 0 and the margin > 0")
        self.rank_default = default
        self.margin = margin
        self._state.rank_cap_default = _near(default)
        for w in self._state.by_key.values():
            w.cap = self._trigger(w)
        self._sync_recent()

    def set_rank_capacity(self, w: RankRecord, capacity: Mapping[str, int] | None) -> int:
        """Rank ``w`` holds at most ``capacity`` engine blocks per canonical tier (None: not
        known); evicts what its new cap leaves over at once and returns it."""
        if capacity is None:
            w.capacity = None
        else:
            by_id: dict[int, int] = {}
            for name, n in capacity.items():
                if name not in CANONICAL_TIERS or n < 0:
                    raise ValueError(f"bad capacity {name}={n}")
                t = CANONICAL_TIERS.index(name)
                by_id[t] = by_id.get(t, 0) + int(n)
            w.capacity = by_id
        w.cap = self._trigger(w)
        self._sync_recent()
        return self.over_cap(w) if w.cap and w.entries() > w.cap else 0

    def rank_cap(self, w: RankRecord) -> tuple[int, str]:
        """Rank ``w``'s cap now (0: none) and where it comes from: "capacity", "default", "".
        An approximate rank's is its GPU capacity itself: its tree is a guess of that cache."""
        default = self.rank_default
        cap = w.capacity
        if w.approximate:
            gpu = (cap or {}).get(GPU, 0)
            return (gpu, "capacity") if gpu else (default, "default" if default else "")
        if cap is None:
            return default, "default" if default else ""
        derived = self._from_capacity(cap)
        if self._unsized(w, cap):
            if not default:
                return 0, ""
            if default > derived:
                return default, "default"
        return derived, "capacity"

    def refresh(self, w: RankRecord) -> int:
        """Rank ``w`` changed kind (events or approximate): its cap follows; evicts what it
        leaves over and returns it."""
        w.cap = self._trigger(w)
        return self.over_cap(w) if w.cap and w.entries() > w.cap else 0

    @property
    def active(self) -> bool:
        """Some cap is on (the writer then folds recency marks every round)."""
        return self._recent is not None

    def _trigger(self, w: RankRecord) -> int:
        """``w.cap``: where the rank nears the cap its capacity (or the default) gives it; a
        rank holding tiers of no reported size finds its true cap in ``over_cap``. An
        approximate rank forgets at its cap exactly."""
        if w.approximate:
            return self.rank_cap(w)[0]
        if w.capacity is None:
            return _near(self.rank_default)
        return _near(self._from_capacity(w.capacity))

    def _from_capacity(self, capacity: Mapping[int, int]) -> int:
        """The cap a reported capacity (engine blocks per tier) gives: its sum times the margin."""
        return max(1, math.ceil(sum(capacity.values()) * self.margin))

    def _recount(self) -> int:
        """Count every rank's entries exactly into the running total; returns it."""
        total = 0
        for w in self._state.by_key.values():
            w.counted = w.entries()
            total += w.counted
        self._state.counted_total = total
        return total

    def _sync_recent(self) -> None:
        on = bool(self.max_entries or self.rank_default) or any(
            w.capacity is not None for w in self._state.by_key.values()
        )
        if on and self._recent is None:
            self._recent = deque(maxlen=RECENT_REQUESTS)
        elif not on:
            self._recent = None
            self._marked.clear()
        # a side record, not index state: ``match`` stays a read
        self._matcher.recent = self._recent

    @staticmethod
    def _unsized(w: RankRecord, cap: Mapping[int, int]) -> bool:
        """``w`` holds blocks on a tier whose size it did not report."""
        paged = w.rechunk.tier_counts if w.rechunk is not None else None
        for t in range(MAX_TIERS):
            if t not in cap and (w.tier_counts[t] or (paged is not None and paged[t])):
                return True
        return False

    # ------------------------------------------------------------- the writer

    def over_cap(self, w: RankRecord) -> int:
        """The applier saw rank ``w`` past ``w.cap``: near its cap, its matches count from now
        on; past it, its least recently used entries go, down to ``slack`` under it. Returns
        the entries evicted. An approximate rank forgets its least recently sent blocks."""
        cap, source = self.rank_cap(w)
        if w.approximate:
            return approx_trim(self._state, w, cap)
        n = w.entries()
        if not cap or n <= _near(cap):
            return 0
        self._hot.add(w)
        if n <= cap:
            return 0
        self.fold()
        if not w.cap_warned:
            w.cap_warned = True
            why = (
                f"its KV capacity of {sum((w.capacity or {}).values())} blocks x {self.margin:g}"
                if source == "capacity"
                else "the default cap per rank (its capacity is not known)"
            )
            log.warning(
                "worker %s rank %d holds %d entries, past its cap of %d (%s): it announces "
                "more blocks than it can hold; its least recently used entries are evicted "
                "and counted (logged once per rank)",
                w.key[0],
                w.key[1],
                n,
                cap,
                why,
            )
        got = self._evict(w, n - (cap - _slack(cap)))
        w.stats.rank_evicted_entries += got
        w.counted -= got
        self._state.counted_total -= got
        return got

    def enforce_cap(self) -> int:
        """Fold the requests matched since the last call into marks while a cap is near, then,
        when over the global cap, evict down to ``slack`` under it, every rank alike; returns
        the entries evicted. The writer calls it once per round."""
        recent = self._recent
        if recent is None:
            return 0
        state = self._state
        hot = self._hot
        for w in [w for w in hot if state.by_key.get(w.key) is not w or not self._is_near(w)]:
            hot.discard(w)
        cap = self.max_entries
        if hot or (cap and state.counted_total > _near(cap)):
            self.fold()
        else:
            while len(recent) > IDLE_RECENT:
                recent.popleft()
        if not cap or state.counted_total <= cap or self._recount() <= cap:
            return 0
        ranks = [w for w in state.by_key.values() if w.counted]
        excess = state.counted_total - cap + _slack(cap)
        evicted = 0
        while excess > 0 and ranks:
            share = -(-excess // len(ranks))
            for w in list(ranks):
                want = min(share, excess)
                got = self._evict(w, want)
                w.stats.evicted_entries += got
                evicted += got
                excess -= got
                if got < want:
                    ranks.remove(w)  # nothing left to give
                if excess <= 0:
                    break
        self.evicted_entries += evicted
        self._recount()
        return evicted

    def _is_near(self, w: RankRecord) -> bool:
        cap = self.rank_cap(w)[0]
        return bool(cap) and w.entries() > _near(cap)

    def fold(self) -> None:
        """The matched requests recorded since the last fold, into marks."""
        recent = self._recent
        if not recent:
            return
        marked = self._marked
        present = self._state.present
        while recent:
            for h in recent.popleft():
                m = present.get(h, 0)
                if not m:
                    break  # the matched prefix ends where no worker holds a block
                marked[h] = m
        if len(marked) > 2 * len(present) + 4096:  # marks of blocks long gone
            self._marked = {h: m & present.get(h, 0) for h, m in marked.items()}
            self._marked = {h: m for h, m in self._marked.items() if m}

    # ------------------------------------------------------------------ sweeps

    def _evict(self, w: RankRecord, count: int) -> int:
        """Evict about ``count`` of rank ``w``'s least recently used entries; the entries gone."""
        before = w.entries()
        goal = before - count
        if w.table and count > 0:
            self._sweep_table(w, count)
        if w.rechunk is not None and w.entries() > goal:
            self._sweep_paged(w, goal)
        return before - w.entries()

    def _sweep_table(self, w: RankRecord, count: int) -> None:
        table, bit, marked = w.table, w.bit, self._marked
        done = 0
        while done < count and table:
            victims: list[EngineHash] = []
            for e in list(islice(table, count - done)):
                h = table[e]
                m = marked.get(h, 0)
                if m & bit:  # matched since the hand last passed: a second chance
                    m &= ~bit
                    if m:
                        marked[h] = m
                    else:
                        del marked[h]
                    del table[e]
                    table[e] = h
                    continue
                victims.append(e)
            if victims:
                self._drop(w, victims)
                done += len(victims)

    def _drop(self, w: RankRecord, victims: list[EngineHash]) -> None:
        """Evict ``victims`` (keys of ``w.table``) from every tier."""
        i, n = 0, len(victims)
        state = self._state
        while i < n:
            if not w.multi and not w.dups:
                # GPU-only blocks: the C loop of removals (it stops at one that is not)
                stop = remove_gpu(w.table, w.emask, state.present, ~w.bit, victims, i)
                w.tier_counts[0] -= stop - i
                i = stop
                if i == n:
                    break
            e = victims[i]
            mask = w.emask.get(e, 1)
            w.dups.pop(e, None)
            t = 0
            while mask:
                if mask & 1:
                    state.remove_tier(w, e, t)
                mask >>= 1
                t += 1
            i += 1

    def _sweep_paged(self, w: RankRecord, goal: int) -> None:
        rt = w.rechunk
        assert rt is not None
        blocks = rt.blocks
        bit, marked = w.bit, self._marked
        renewed: set[EngineHash] = set()
        used: set[int] = set()  # router hashes whose mark gave a second chance
        start = 0  # blocks before it: none to evict in this sweep
        while w.entries() > goal:
            window = list(islice(blocks, start, start + max(64, w.entries() - goal)))
            if not window:
                break
            progress = False
            for e in window:
                eb = blocks.get(e)
                if eb is None or not eb.tiers:
                    continue  # gone, or empty and kept for a held block's router block
                if e not in renewed:
                    hit = [h for h in eb.routers if marked.get(h, 0) & bit]
                    if hit:
                        used.update(hit)
                        renewed.add(e)
                        rt.renew(e)
                        progress = True
                        continue
                w.dups.pop(e, None)
                rt.evict(e)
                progress = True
                if w.entries() <= goal:
                    break
            if not progress:
                start += len(window)
        for h in used:
            m = marked.get(h, 0) & ~bit
            if m:
                marked[h] = m
            else:
                marked.pop(h, None)
