"""The index's state, and its only owner: worker slots and tables, the tier registry, and the
global masks (router hash -> slots holding it, in total and per lower tier).

- per ``(worker_id, dp_rank)`` (a ``RankRecord``): the engine hash of every block it announced ->
  the router hash of that block and the tiers holding it, duplicate-store counts, page size;
- globally: router hash -> bitmask of the worker *slots* holding it (any tier), plus, only for
  blocks some worker holds off-GPU, the slots holding it per lower tier (GPU-only fleets pay
  nothing for tiers);
- the tier registry: canonical tiers by name (``types.GPU``, ``types.EXTERNAL``), then unknown
  mediums while tier bits remain; names counted per worker, bounded, freed with the worker.

Every change to an entry's tiers goes through the methods here (``add_block``, ``add_tier``,
``remove_tier``, ``set_mask``, ``drop_entries``), which keep a worker's table and the global masks
in step. The collaborators (``apply``, ``match``, ``evict``, ``rechunk``, ``snapshot``) receive
this object; the two hot ones bind its containers once, so those are mutated in place and never
rebound. The C store/remove loops of ``apply`` are the one writer that bypasses the methods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from indexer.events import CANONICAL_TIERS, EngineHash
from indexer.index.native import new_present
from indexer.index.types import (
    MAX_TIERS,
    MAX_UNKNOWN_MEDIUMS,
    RankRecord,
    WorkerIndexStats,
    WorkerKey,
)

__all__ = ["IndexState"]


class IndexState:
    """The rank tables, tier registry and global masks. See the module docstring."""

    def __init__(self, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.by_key: dict[WorkerKey, RankRecord] = {}
        self.by_slot: list[RankRecord | None] = []
        self.free_slots: list[int] = []
        #: Bits of the slots in use (an int: read through this object, never bound).
        self.all_bits = 0
        self._keys_cache: list[WorkerKey] | None = None
        #: slot -> engine page size, for workers whose credit rounds down to whole pages
        self.paged: dict[int, int] = {}
        self.present: dict[int, int] = new_present()
        # slots holding a block on no GPU tier at all, and per lower tier the slots holding it
        self.nogpu: dict[int, int] = {}
        self.low: list[dict[int, int]] = [{} for _ in range(MAX_TIERS)]
        #: Tier names by tier id: the canonical ones, then unknown mediums in arrival order.
        self.tier_names: list[str] = list(CANONICAL_TIERS)
        self.tier_ids: dict[str, int] = {n: i for i, n in enumerate(CANONICAL_TIERS)}
        #: Tiers outside the canonical ones that were seen (scored like EXTERNAL).
        self.unknown_tiers: dict[str, int] = {}
        #: ``RankRecord.cap`` of a new rank (set by ``evict``, from the default cap per rank).
        self.rank_cap_default = 0
        #: Entries in all as counted batch by batch (``RankRecord.counted``: the applier adds a
        #: batch's, dropping a rank's entries takes them off, the evictor recounts when past it).
        self.counted_total = 0

    # ------------------------------------------------------------------ workers

    def add_worker(self, worker_id: str, dp_rank: int = 0, *, model: str = "") -> None:
        key = (worker_id, dp_rank)
        if key in self.by_key:
            self.by_key[key].model = model
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot = len(self.by_slot)
            self.by_slot.append(None)
        w = RankRecord(key, slot, model)
        w.cap = self.rank_cap_default
        self.by_key[key] = w
        self.by_slot[slot] = w
        self.all_bits |= w.bit
        self._keys_cache = None

    def remove_worker(self, worker_id: str, dp_rank: int | None = None) -> None:
        keys = [
            k for k in self.by_key if k[0] == worker_id and (dp_rank is None or k[1] == dp_rank)
        ]
        for key in keys:
            w = self.by_key.pop(key)
            self.drop_entries(w)
            self.paged.pop(w.slot, None)
            self.by_slot[w.slot] = None
            self.free_slots.append(w.slot)
            self.all_bits &= ~w.bit
            self._keys_cache = None

    def clear_worker(self, worker_id: str, dp_rank: int) -> None:
        w = self.by_key.get((worker_id, dp_rank))
        if w is not None:
            self.drop_entries(w)
            w.stats.cleared += 1

    def workers(self) -> list[WorkerKey]:
        return list(self.by_key)

    def slot(self, key: WorkerKey) -> int:
        return self.by_key[key].slot

    def worker(self, key: WorkerKey) -> RankRecord:
        """One worker rank's record (KeyError when unknown)."""
        return self.by_key[key]

    def items(self) -> list[tuple[WorkerKey, RankRecord]]:
        return list(self.by_key.items())

    def slot_keys(self) -> list[WorkerKey]:
        """Rank keys in slot order, cached until a worker comes or goes (valid as a per-slot
        list only while no slot is free)."""
        keys = self._keys_cache
        if keys is None:
            keys = self._keys_cache = [w.key for w in self.by_slot if w is not None]
        return keys

    def worker_stats(self, key: WorkerKey) -> WorkerIndexStats:
        w = self.by_key[key]
        counts = w.tier_counts
        if w.rechunk is not None:
            counts = [a + b for a, b in zip(counts, w.rechunk.tier_counts)]
        w.stats.blocks_by_tier = {
            self.tier_names[i]: c for i, c in enumerate(counts) if c or i < len(CANONICAL_TIERS)
        }
        w.stats.source = "approximate" if w.approximate else "events"
        return w.stats

    def __len__(self) -> int:
        """Number of distinct router blocks held by at least one worker."""
        return len(self.present)

    def entries(self) -> int:
        """Number of (engine block, worker) entries."""
        n = 0
        for w in self.by_key.values():
            n += len(w.table)
            if w.rechunk is not None:
                n += len(w.rechunk.blocks)
        return n

    # ---------------------------------------------------------- tier registry

    def tier_id(self, name: str, w: RankRecord | None = None) -> int:
        t = self.tier_ids.get(name)
        if t is None:
            # New unknown medium: its own tier while bits remain, then the last one shared, and
            # then the name is not kept (a publisher may send any number of names).
            t = len(self.tier_names)
            if t >= MAX_TIERS:
                t = MAX_TIERS - 1
            else:
                self.tier_names.append(name)
                self.tier_ids[name] = t
        if t >= len(CANONICAL_TIERS):
            if name in self.unknown_tiers or len(self.unknown_tiers) < MAX_TIERS:
                self.unknown_tiers[name] = self.unknown_tiers.get(name, 0) + 1
            if w is not None:
                um = w.stats.unknown_mediums
                if name not in um and len(um) >= MAX_UNKNOWN_MEDIUMS:
                    name = "OTHER"
                um[name] = um.get(name, 0) + 1
        return t

    def set_page(self, w: RankRecord, page: int) -> None:
        """Record the engine's page size: credit on this worker is rounded down to whole pages."""
        if page == w.page:
            return
        w.page = page
        bs = self.block_size
        if page > bs or bs % page:
            self.paged[w.slot] = page
        else:
            self.paged.pop(w.slot, None)

    # ---------------------------------------------------------------- entries

    def count_dup(self, w: RankRecord, e: EngineHash, t: int) -> None:
        """Another store of ``e`` on tier ``t``, which already holds it."""
        d = w.dups.get(e)
        if d is None:
            d = w.dups[e] = {}
        d[t] = d.get(t, 0) + 1
        w.stats.duplicate_stores += 1

    def add_block(self, w: RankRecord, h: int, e: EngineHash, bit: int) -> None:
        """Engine block ``e`` (just entered in ``w.table``) brings router block ``h`` on ``bit``."""
        multi = w.multi.get(h)
        if multi is not None:
            old = _or_all(multi)
            multi[e] = bit
            self.set_mask(w, h, old, old | bit)
            return
        if self.present.get(h, 0) & w.bit:
            # Another engine block of this worker already maps to h (same tokens, different
            # cache salt or extra keys). Before this moment exactly one did, so ``None`` names
            # that one block precisely: its later updates find no key of their own and use it.
            old = self.worker_mask(w, h)
            w.multi[h] = {None: old, e: bit}
            self.set_mask(w, h, old, old | bit)
            return
        self.set_mask(w, h, 0, bit)

    def add_tier(self, w: RankRecord, e: EngineHash, bit: int, t: int) -> None:
        """Tier ``t`` (``bit``) also holds ``w``'s known engine block ``e``."""
        own = w.emask.get(e, 1)
        if own & bit:
            self.count_dup(w, e, t)
            return
        own |= bit
        w.emask[e] = own
        w.tier_counts[t] += 1
        h = w.table[e]
        multi = w.multi.get(h)
        if multi is None:
            self.set_mask(w, h, own & ~bit, own)
        else:
            old = _or_all(multi)
            multi[e if e in multi else None] = own
            self.set_mask(w, h, old, old | bit)

    def remove_tier(self, w: RankRecord, e: EngineHash, t: int) -> None:
        """Tier ``t`` no longer holds ``w``'s engine block ``e``; it leaves with its last tier."""
        own = w.emask.get(e, 1)
        bit = 1 << t
        if not own & bit:
            w.stats.unknown_removals += 1
            return
        w.tier_counts[t] -= 1
        own &= ~bit
        h = w.table[e]
        if own == 1:
            del w.emask[e]
        elif own:
            w.emask[e] = own
        else:
            del w.table[e]
            w.emask.pop(e, None)
        multi = w.multi.get(h)
        if multi is None:
            self.set_mask(w, h, own | bit, own)
            return
        old = _or_all(multi)
        k: EngineHash | None = e if e in multi else None
        if own:
            multi[k] = own
        else:
            multi.pop(k, None)
        new = _or_all(multi)
        if len(multi) <= 1:
            # one engine block left: its own packed entry carries the mask again
            del w.multi[h]
        self.set_mask(w, h, old, new)

    def drop_entries(self, w: RankRecord) -> None:
        """Forget every block of ``w`` (the worker stays)."""
        bit = w.bit
        if w.table or w.rechunk is not None:
            keep = ~bit
            for d in (self.present, self.nogpu, *self.low):
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
        self.counted_total -= w.counted
        w.counted = 0
        w.table = {}
        w.emask = {}
        w.multi = {}
        w.dups = {}
        w.rechunk = None
        w.tier_counts = [0] * MAX_TIERS

    def holds(self, key: WorkerKey, h: int) -> bool:
        """Whether rank ``key`` holds router block ``h`` on any tier."""
        w = self.by_key.get(key)
        return w is not None and bool(self.present.get(h, 0) & w.bit)

    def worker_mask(self, w: RankRecord, h: int) -> int:
        """Tier mask of router block ``h`` on worker ``w`` as the global tables hold it."""
        bit = w.bit
        if not self.present.get(h, 0) & bit:
            return 0
        mask = 0 if self.nogpu.get(h, 0) & bit else 1
        for t in range(1, len(self.tier_names)):
            if self.low[t].get(h, 0) & bit:
                mask |= 1 << t
        return mask

    def set_mask(self, w: RankRecord, h: int, old: int, new: int) -> None:
        """Move worker ``w``'s tier mask of router block ``h`` from ``old`` to ``new``."""
        if old == new:
            return
        bit = w.bit
        present = self.present
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
            _toggle(self.nogpu, h, bit, new_ng)
        changed = (old ^ new) >> 1
        t = 1
        while changed:
            if changed & 1:
                _toggle(self.low[t], h, bit, bool(new >> t & 1))
            changed >>= 1
            t += 1

    # --------------------------------------------------------------- listings

    def block_tiers(self, key: WorkerKey, hashes: Sequence[int]) -> list[frozenset[str]]:
        """Tiers holding each leading block of ``hashes`` on one worker, up to the first gap."""
        w = self.by_key[key]
        out: list[frozenset[str]] = []
        for h in hashes:
            mask = self.worker_mask(w, h)
            if not mask:
                break
            out.append(frozenset(self.tier_names[t] for t in range(MAX_TIERS) if mask >> t & 1))
        return out

    def engine_blocks(self, key: WorkerKey) -> dict[str, set[EngineHash]]:
        """Engine hashes per tier on one worker: the listing the engines' ground-truth tests use."""
        w = self.by_key[key]
        out: dict[str, set[EngineHash]] = {}
        emask = w.emask
        items: list[tuple[EngineHash, int]] = [(e, emask.get(e, 1)) for e in w.table]
        if w.rechunk is not None:
            items += [(e, b.tiers) for e, b in w.rechunk.blocks.items()]
        for e, mask in items:
            for t in range(MAX_TIERS):
                if mask >> t & 1:
                    out.setdefault(self.tier_names[t], set()).add(e)
        return out


def _or_all(d: Mapping[Any, int]) -> int:
    """The union of a ``RankRecord.multi`` entry's masks."""
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
