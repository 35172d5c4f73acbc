"""Matching a request against the index state: the one entry point ``match``.

Walks a request's router hashes once and reports, per worker, the matched prefix length and the
blocks per (fastest) tier, in O(blocks + workers) big-int operations; on a worker whose engine
pages are larger than a router block, rounded down to whole pages (the engine reuses no partial
page). Read-only: request handlers call it between the writer's turns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import groupby
from typing import Any

from indexer.hashing import chain_hashes, request_seed
from indexer.index.native import walk_lengths as _walk_lengths
from indexer.index.native import walk_overlay as _walk_overlay
from indexer.index.state import IndexState
from indexer.index.types import EXTERNAL, MAX_TIERS, ZERO, MatchResult, WorkerKey, WorkerMatch

__all__ = ["RECORD_BLOCKS", "Matcher"]

#: Hashes of one request kept in ``Matcher.recent`` (a 64 K-token prefix at 16-token blocks).
RECORD_BLOCKS = 4096


class Matcher:
    """The index's reader side, over one ``IndexState``."""

    def __init__(self, state: IndexState) -> None:
        self._state = state
        # Bound once: the walks read them without going through ``self._state`` (the state
        # mutates these containers in place, never rebinds them; ``all_bits`` is an int, so it
        # is read from the state).
        self.block_size = state.block_size
        self._present = state.present
        self._nogpu = state.nogpu
        self._low = state.low
        self._workers = state.by_key
        self._by_slot = state.by_slot
        self._free_slots = state.free_slots
        self._paged = state.paged
        self._tier_names = state.tier_names
        self._tier_ids = state.tier_ids
        #: Requests matched lately (their first ``RECORD_BLOCKS`` hashes), for the caps'
        #: recency marks (``indexer.index.evict``); None without a cap.
        self.recent: deque[Sequence[int]] | None = None

    def request_hashes(
        self,
        token_ids: Sequence[int],
        *,
        model: str = "",
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        return chain_hashes(token_ids, self.block_size, request_seed(model, lora_name, cache_salt))

    def match(
        self,
        hashes: Sequence[int],
        *,
        overlay: Mapping[int, int] | None = None,
        pools: Sequence[Iterable[WorkerKey]] = (),
    ) -> MatchResult:
        """Per worker: matched prefix blocks, and how many sit on each (fastest) tier; on a
        worker with engine pages larger than a router block, whole pages only."""
        if self.recent is not None:  # bounded: a huge request's tail is rarely anyone's prefix
            self.recent.append(hashes if len(hashes) <= RECORD_BLOCKS else hashes[:RECORD_BLOCKS])
        res = self._match(hashes, overlay, pools)
        return self._round_pages(res) if self._paged else res

    def _round_pages(self, res: MatchResult) -> MatchResult:
        """Round each paged worker's match down to whole engine pages: the engine reuses no
        partial page. The blocks taken off are the prefix's tail: predicted ones first (they lie
        past the held prefix), then the slowest tiers."""
        bs = self.block_size
        workers = dict(res.workers)
        for slot, page in self._paged.items():
            w = self._by_slot[slot]
            if w is None:
                continue
            wm = workers.get(w.key)
            if wm is None or not wm.matched_blocks:
                continue
            m = wm.matched_blocks
            keep = (m * bs // page) * page // bs
            if keep == m:
                continue
            cut = m - keep
            pred = wm.predicted_blocks
            take = min(cut, pred)
            pred -= take
            cut -= take
            by_tier = dict(wm.by_tier)
            for name in sorted(by_tier, key=self._tier_order, reverse=True):
                if not cut:
                    break
                take = min(cut, by_tier[name])
                by_tier[name] -= take
                cut -= take
            workers[w.key] = WorkerMatch(keep, by_tier, pred)
        return MatchResult(res.request_blocks, workers)

    def _tier_order(self, name: str) -> int:
        t = self._tier_ids.get(name)
        return MAX_TIERS if t is None else t

    def _match(
        self,
        hashes: Sequence[int],
        overlay: Mapping[int, int] | None,
        pools: Sequence[Iterable[WorkerKey]],
    ) -> MatchResult:
        """Per worker: matched prefix blocks, and how many sit on each (fastest) tier.

        ``overlay``: router hash -> slots predicted to hold it; counted as present, reported as
        ``predicted_blocks``. ``pools``: groups of workers that share an EXTERNAL store; each member
        is credited with EXTERNAL for a block any member holds there.

        The walk looks blocks up in C (``map``) and then visits only the *runs* of equal holder
        sets (``groupby``): along a shared prefix the holders change rarely, so the Python-level
        work is O(runs + workers), not O(blocks x workers). The returned ``WorkerMatch`` objects
        may be shared between workers and must be treated as read-only.
        """
        if self._nogpu or (pools and self._low[EXTERNAL]):
            return self._match_general(hashes, overlay, pools)
        if overlay:
            # predictions too: the same C walk with the overlay (up to 64 slots), else per run
            if _walk_overlay is not None and type(overlay) is dict:
                if type(hashes) is not list:
                    hashes = list(hashes)
                r = _walk_overlay(
                    self._present, overlay, hashes, self._state.all_bits, len(self._by_slot)
                )
                if r is not None:
                    return self._result(len(hashes), r[0], r[1])
            return self._match_overlay(hashes, overlay)
        # GPU-only holders and nothing to overlay: the walk is a C loop over the blocks.
        if type(hashes) is not list:
            hashes = list(hashes)
        lengths, _ = _walk_lengths(self._present, hashes, self._state.all_bits, len(self._by_slot))
        return self._result(len(hashes), lengths)

    def _match_overlay(self, hashes: Sequence[int], overlay: Mapping[int, int]) -> MatchResult:
        """GPU-only holders plus predictions: predictions are recorded as chain segments, so
        along a request the (held, predicted) pair changes rarely and the work is per run."""
        alive = self._state.all_bits
        ended: dict[int, int] = {}
        counts: dict[int, dict[int, int]] = {}
        pos = 0
        for (p, o), grp in groupby(zip(map(self._present.get, hashes), map(overlay.get, hashes))):
            pred = o & ~p if o and p else o or 0
            p = (p or 0) | pred
            if not p:
                break
            if alive & ~p:
                alive = _end_slots(alive, p, ended, pos)
                if not alive:
                    break
            length = len(list(grp))
            pred &= alive
            while pred:
                lowbit = pred & -pred
                slot = lowbit.bit_length() - 1
                pred ^= lowbit
                c = counts.setdefault(slot, {})
                c[-1] = c.get(-1, 0) + length
            pos += length
        return self._build(len(hashes), pos, ended, counts)

    def _match_general(
        self,
        hashes: Sequence[int],
        overlay: Mapping[int, int] | None,
        pools: Sequence[Iterable[WorkerKey]],
    ) -> MatchResult:
        n = len(hashes)
        vals: list[int | None] = list(map(self._present.get, hashes))
        extras = self._extras(hashes, vals, overlay, pools)
        seq: list[Any] = vals if extras is None else list(zip(vals, extras))
        alive = self._state.all_bits
        ended: dict[int, int] = {}
        runs: list[tuple[int, int, tuple[int, ...]]] = []
        pos = 0
        for key, grp in groupby(seq):
            if extras is None:
                p, extra = key, None
            else:
                p, extra = key
            if not p:
                break
            if alive & ~p:
                alive = _end_slots(alive, p, ended, pos)
                if not alive:
                    break
            length = len(list(grp))
            if extra:
                runs.append((pos, pos + length, extra))
            pos += length
        counts = self._count_runs(runs, pos, ended) if runs else {}
        return self._build(n, pos, ended, counts)

    def _result(self, n: int, lengths: list[int], preds: list[int] | None = None) -> MatchResult:
        """Per-worker answer from per-slot lengths (and predicted blocks), with one shared object
        per distinct length and the dict built by C-level zip/map (no per-worker bytecode)."""
        shared = {m: WorkerMatch(m, {"GPU": m}) for m in set(lengths)}
        shared[0] = ZERO
        if preds is not None and any(preds):
            return MatchResult(
                n,
                {
                    w.key: WorkerMatch(m, {"GPU": m - p}, p) if p else shared[m]
                    for w in self._by_slot
                    if w is not None
                    for m, p in ((lengths[w.slot], preds[w.slot]),)
                },
            )
        if not self._free_slots:
            keys = self._state.slot_keys()
            return MatchResult(n, dict(zip(keys, map(shared.__getitem__, lengths))))
        return MatchResult(
            n, {w.key: shared[lengths[w.slot]] for w in self._by_slot if w is not None}
        )

    def _build(
        self, n: int, pos: int, ended: dict[int, int], counts: dict[int, dict[int, int]]
    ) -> MatchResult:
        workers: dict[WorkerKey, WorkerMatch] = {}
        shared: dict[int, WorkerMatch] = {0: ZERO}
        names = self._tier_names
        if not counts:
            ended_get, shared_get = ended.get, shared.get
            for w in self._workers.values():
                m = ended_get(w.slot, pos)
                wm = shared_get(m)
                if wm is None:
                    wm = shared[m] = WorkerMatch(m, {"GPU": m})
                workers[w.key] = wm
            return MatchResult(n, workers)
        for w in self._workers.values():
            m = ended.get(w.slot, pos)
            c = counts.get(w.slot)
            if c is None:
                wm = shared.get(m)
                if wm is None:
                    wm = shared[m] = WorkerMatch(m, {"GPU": m})
                workers[w.key] = wm
                continue
            pred = c.pop(-1, 0)
            by_tier = {"GPU": m - pred - sum(c.values())}
            for t, k in sorted(c.items()):
                by_tier[names[t]] = k
            workers[w.key] = WorkerMatch(m, by_tier, pred)
        return MatchResult(n, workers)

    def _extras(
        self,
        hashes: Sequence[int],
        vals: list[int | None],
        overlay: Mapping[int, int] | None,
        pools: Sequence[Iterable[WorkerKey]],
    ) -> list[tuple[int, ...] | None] | None:
        """Per block: (predicted, then per lower tier) slot masks, or None where all are zero.

        Adds predicted and pool-credited holders into ``vals``. Returns None when no block has
        any, which keeps the common GPU-only walk free of per-block Python work.
        """
        n = len(hashes)
        tiers = self._extra_tiers()
        index_of = {t: j + 1 for j, t in enumerate(tiers)}
        out: dict[int, list[int]] = {}

        def slot_of(i: int) -> list[int]:
            e = out.get(i)
            if e is None:
                e = out[i] = [0] * (len(tiers) + 1)
            return e

        if overlay:
            ovs = list(map(overlay.get, hashes))
            if ovs.count(None) != n:
                for i, o in enumerate(ovs):
                    if o:
                        p = vals[i] or 0
                        pred = o & ~p
                        if pred:
                            vals[i] = p | pred
                            slot_of(i)[0] = pred
        nogpu = self._nogpu
        if nogpu:
            ngs = list(map(nogpu.get, hashes))
            if ngs.count(None) != n:
                low = self._low
                for i, ng in enumerate(ngs):
                    if ng:
                        h = hashes[i]
                        e = slot_of(i)
                        for t in tiers:
                            m = low[t].get(h, 0) & ng
                            if m:
                                e[index_of[t]] = m
                                ng &= ~m
                                if not ng:
                                    break
        ext = self._low[EXTERNAL]
        if pools and ext:
            pool_masks = [m for m in map(self._pool_mask, pools) if m]
            exts = list(map(ext.get, hashes))
            if pool_masks and exts.count(None) != n:
                j3 = index_of[EXTERNAL]
                for i, e3 in enumerate(exts):
                    if not e3:
                        continue
                    p = vals[i] or 0
                    credit = 0
                    for pm in pool_masks:
                        if e3 & pm:
                            credit |= pm & ~p
                    if credit:
                        vals[i] = p | credit
                        slot_of(i)[j3] |= credit
        if not out:
            return None
        extras: list[tuple[int, ...] | None] = [None] * n
        for i, e in out.items():
            extras[i] = tuple(e)
        return extras

    def _extra_tiers(self) -> list[int]:
        """Lower tiers in scoring order (EXTERNAL always, for pool credit)."""
        return [t for t in range(1, len(self._tier_names)) if t == EXTERNAL or self._low[t]]

    def _count_runs(
        self, runs: list[tuple[int, int, tuple[int, ...]]], end: int, ended: dict[int, int]
    ) -> dict[int, dict[int, int]]:
        tiers = [-1, *self._extra_tiers()]
        counts: dict[int, dict[int, int]] = {}
        for start, stop, key in runs:
            for j, mask in enumerate(key):
                t = tiers[j]
                while mask:
                    lowbit = mask & -mask
                    slot = lowbit.bit_length() - 1
                    mask ^= lowbit
                    c = min(stop, ended.get(slot, end)) - start
                    if c > 0:
                        d = counts.setdefault(slot, {})
                        d[t] = d.get(t, 0) + c
        return counts

    def _pool_mask(self, members: Iterable[WorkerKey]) -> int:
        m = 0
        for k in members:
            w = self._workers.get(k)
            if w is not None:
                m |= w.bit
        return m


def _end_slots(alive: int, present: int, ended: dict[int, int], pos: int) -> int:
    """The slots of ``alive`` missing from ``present`` end their match at ``pos``; the rest."""
    dead = alive & ~present
    while dead:
        lowbit = dead & -dead
        ended[lowbit.bit_length() - 1] = pos
        dead ^= lowbit
    return alive & present
