"""The index's state, and its only owner: worker slots and tables, the tier registry, and the
global masks (router hash -> slots holding it, in total and per lower tier).

- per ``(worker_id, dp_rank)`` (a ``Worker``): the engine hash of every block it announced ->
  the router hash of that block and the tiers holding it, duplicate-store counts, page size;
- globally: router hash -> bitmask of the worker *slots* holding it (any tier), plus, only for
  blocks some worker holds off-GPU, the slots holding it per lower tier (GPU-only fleets pay
  nothing for tiers);
- the tier registry: canonical tiers by name (``types.GPU``, ``types.EXTERNAL``), then unknown
  mediums while tier bits remain; names counted per worker, bounded, freed with the worker.

``indexer.index.apply`` changes it (events), ``indexer.index.match`` reads it (requests);
``indexer.rechunk`` and ``indexer.snapshot`` go through the methods here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from indexer.events import CANONICAL_TIERS, EngineHash
from indexer.hashing import namespace_seed
from indexer.index.native import new_present
from indexer.index.types import (
    MAX_TIERS,
    MAX_UNKNOWN_MEDIUMS,
    Worker,
    WorkerIndexStats,
    WorkerKey,
)

__all__ = ["IndexState"]


class IndexState:
    """Worker tables, tier registry and global masks. See the module docstring."""

    def __init__(self, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._workers: dict[WorkerKey, Worker] = {}
        self._by_slot: list[Worker | None] = []
        self._free_slots: list[int] = []
        self._all_bits = 0
        self._keys_cache: list[WorkerKey] | None = None
        #: slot -> engine page size, for workers whose credit rounds down to whole pages
        self._paged: dict[int, int] = {}
        self._present: dict[int, int] = new_present()
        # slots holding a block on no GPU tier at all, and per lower tier the slots holding it
        self._nogpu: dict[int, int] = {}
        self._low: list[dict[int, int]] = [{} for _ in range(MAX_TIERS)]
        self._tier_names: list[str] = list(CANONICAL_TIERS)
        self._tier_ids: dict[str, int] = {n: i for i, n in enumerate(CANONICAL_TIERS)}
        #: Tiers outside the canonical four that were seen (scored like EXTERNAL).
        self.unknown_tiers: dict[str, int] = {}
        #: Optional cap on (engine block, worker) entries, enforced by ``evict.Evictor``; 0: none.
        self.max_entries = 0
        #: Requests matched since the last eviction sweep (their hashes), only with a cap: the
        #: recency the sweep folds in. A side record, not index state: ``match`` stays a read.
        self._recent: deque[Sequence[int]] | None = None
        #: Router hashes matched since the eviction hand last passed them (see ``evict``).
        self._marked: set[int] = set()
        self.evicted_entries = 0

    def add_worker(self, worker_id: str, dp_rank: int = 0, *, model: str = "") -> None:
        key = (worker_id, dp_rank)
        if key in self._workers:
            self._workers[key].model = model
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = len(self._by_slot)
            self._by_slot.append(None)
        w = Worker(key, slot, model)
        self._workers[key] = w
        self._by_slot[slot] = w
        self._all_bits |= w.bit
        self._keys_cache = None

    def remove_worker(self, worker_id: str, dp_rank: int | None = None) -> None:
        keys = [
            k for k in self._workers if k[0] == worker_id and (dp_rank is None or k[1] == dp_rank)
        ]
        for key in keys:
            w = self._workers.pop(key)
            self._drop_entries(w)
            self._paged.pop(w.slot, None)
            self._by_slot[w.slot] = None
            self._free_slots.append(w.slot)
            self._all_bits &= ~w.bit
            self._keys_cache = None

    def clear_worker(self, worker_id: str, dp_rank: int) -> None:
        w = self._workers.get((worker_id, dp_rank))
        if w is not None:
            self._drop_entries(w)
            w.stats.cleared += 1

    def workers(self) -> list[WorkerKey]:
        return list(self._workers)

    def slot(self, key: WorkerKey) -> int:
        return self._workers[key].slot

    def worker(self, key: WorkerKey) -> Worker:
        """One worker rank's record (KeyError when unknown)."""
        return self._workers[key]

    def items(self) -> list[tuple[WorkerKey, Worker]]:
        return list(self._workers.items())

    @property
    def tier_names(self) -> list[str]:
        """Tier names by tier id: the canonical four, then unknown mediums in arrival order."""
        return self._tier_names

    def worker_stats(self, key: WorkerKey) -> WorkerIndexStats:
        w = self._workers[key]
        counts = w.tier_counts
        if w.rechunk is not None:
            counts = [a + b for a, b in zip(counts, w.rechunk.tier_counts)]
        w.stats.blocks_by_tier = {
            self._tier_names[i]: c for i, c in enumerate(counts) if c or i < len(CANONICAL_TIERS)
        }
        return w.stats

    def __len__(self) -> int:
        """Number of distinct router blocks held by at least one worker."""
        return len(self._present)

    def entries(self) -> int:
        """Number of (engine block, worker) entries."""
        n = 0
        for w in self._workers.values():
            n += len(w.table)
            if w.rechunk is not None:
                n += len(w.rechunk.blocks)
        return n

    def tier_id(self, name: str, w: Worker | None = None) -> int:
        t = self._tier_ids.get(name)
        if t is None:
            # New unknown medium: its own tier while bits remain, then the last one shared, and
            # then the name is not kept (a publisher may send any number of names).
            t = len(self._tier_names)
            if t >= MAX_TIERS:
                t = MAX_TIERS - 1
            else:
                self._tier_names.append(name)
                self._tier_ids[name] = t
        if t >= len(CANONICAL_TIERS):
            if name in self.unknown_tiers or len(self.unknown_tiers) < MAX_TIERS:
                self.unknown_tiers[name] = self.unknown_tiers.get(name, 0) + 1
            if w is not None:
                um = w.stats.unknown_mediums
                if name not in um and len(um) >= MAX_UNKNOWN_MEDIUMS:
                    name = "OTHER"
                um[name] = um.get(name, 0) + 1
        return t

    def seed(self, w: Worker, lora_name: str | None, lora_id: int | None) -> int:
        if lora_name is None and lora_id is not None:
            lora_name = f"lora-id:{lora_id}"
        return namespace_seed(w.model, lora_name)

    def set_page(self, w: Worker, page: int) -> None:
        """Record the engine's page size: credit on this worker is rounded down to whole pages."""
        if page == w.page:
            return
        w.page = page
        bs = self.block_size
        if page > bs or bs % page:
            self._paged[w.slot] = page
        else:
            self._paged.pop(w.slot, None)

    def count_dup(self, w: Worker, e: EngineHash, t: int) -> None:
        """Another store of ``e`` on tier ``t``, which already holds it."""
        d = w.dups.get(e)
        if d is None:
            d = w.dups[e] = {}
        d[t] = d.get(t, 0) + 1
        w.stats.duplicate_stores += 1

    def _drop_entries(self, w: Worker) -> None:
        bit = w.bit
        if w.table or w.rechunk is not None:
            keep = ~bit
            for d in (self._present, self._nogpu, *self._low):
                if not d:
                    continue
                dead = []
                for h, m in d.items():
                    if m & bit:
                        m &= keep
                        if m:
                            d[h] = m
                        else:
                            dead.append(h)
                for h in dead:
                    del d[h]
        w.table = {}
        w.emask = {}
        w.multi = {}
        w.dups = {}
        w.rechunk = None
        w.tier_counts = [0] * MAX_TIERS

    def worker_mask(self, w: Worker, h: int) -> int:
        """Tier mask of router block ``h`` on worker ``w`` as the global tables hold it."""
        bit = w.bit
        if not self._present.get(h, 0) & bit:
            return 0
        mask = 0 if self._nogpu.get(h, 0) & bit else 1
        for t in range(1, len(self._tier_names)):
            if self._low[t].get(h, 0) & bit:
                mask |= 1 << t
        return mask

    def set_mask(self, w: Worker, h: int, old: int, new: int) -> None:
        """Move worker ``w``'s tier mask of router block ``h`` from ``old`` to ``new``."""
        if old == new:
            return
        bit = w.bit
        present = self._present
        if not old:
            present[h] = present.get(h, 0) | bit
        elif not new:
            m = present[h] & ~bit
            if m:
                present[h] = m
            else:
                del present[h]
        old_ng = bool(old) and not old & 1
        new_ng = bool(new) and not new & 1
        if old_ng != new_ng:
            _toggle(self._nogpu, h, bit, new_ng)
        changed = (old ^ new) >> 1
        t = 1
        while changed:
            if changed & 1:
                _toggle(self._low[t], h, bit, bool(new >> t & 1))
            changed >>= 1
            t += 1

    def block_tiers(self, key: WorkerKey, hashes: Sequence[int]) -> list[frozenset[str]]:
        """Tiers holding each leading block of ``hashes`` on one worker, up to the first gap."""
        w = self._workers[key]
        out: list[frozenset[str]] = []
        for h in hashes:
            mask = self.worker_mask(w, h)
            if not mask:
                break
            out.append(frozenset(self._tier_names[t] for t in range(MAX_TIERS) if mask >> t & 1))
        return out

    def engine_blocks(self, key: WorkerKey) -> dict[str, set[EngineHash]]:
        """Engine hashes per tier on one worker: the listing the engines' ground-truth tests use."""
        w = self._workers[key]
        out: dict[str, set[EngineHash]] = {}
        emask = w.emask
        items: list[tuple[EngineHash, int]] = [(e, emask.get(e, 1)) for e in w.table]
        if w.rechunk is not None:
            items += [(e, b.tiers) for e, b in w.rechunk.blocks.items()]
        for e, mask in items:
            for t in range(MAX_TIERS):
                if mask >> t & 1:
                    out.setdefault(self._tier_names[t], set()).add(e)
        return out


def _or_all(d: Mapping[Any, int]) -> int:
    m = 0
    for v in d.values():
        m |= v
    return m


def _toggle(d: dict[int, int], h: int, bit: int, on: bool) -> None:
    if on:
        d[h] = d.get(h, 0) | bit
    else:
        m = d.get(h, 0) & ~bit
        if m:
            d[h] = m
        else:
            d.pop(h, None)
