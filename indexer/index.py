"""The global prefix index: every worker's cached blocks, by router block hash and storage tier.

Owns (DESIGN §3):

- per ``(worker_id, dp_rank)``: the engine hash of every block it announced → the router hash of
  that block and the tiers holding it;
- globally: router hash → bitmask of the worker *slots* holding it (any tier), plus, only for blocks
  some worker holds off-GPU, the slots holding it per lower tier. GPU-only fleets pay nothing for
  tiers;
- ``match``: walks a request's router hashes once and reports, per worker, the matched prefix length
  and the blocks per (fastest) tier, in O(blocks + workers) big-int operations.

Engines whose page size differs from the router block size go through ``indexer.rechunk``.
Single writer: only the subscriber task calls the mutating methods; nothing here awaits.

What the engine can really reuse (issue 12):

- duplicate stores: an engine may store one hash twice (vLLM recomputes a fully cached prompt's
  last page into a second physical block) and remove it once. Stores are counted per (worker,
  engine hash, tier); the block leaves a tier when its count reaches 0.
- page size: a worker whose events carry ``block_size`` P (its page) can reuse only whole pages,
  so its matched prefix is rounded down to a multiple of P tokens (``_round_pages``).
- extra keys: a block whose ``extra_keys`` (after the LoRA key) are not empty chains from
  ``hashing.extra_seed`` — another namespace for salted and multimodal blocks (``indexer.hashing``).
- hybrid models: presence follows the groups whose ``kv_cache_spec_kind`` keeps the whole prefix
  (``events.FULL_PREFIX_KINDS``). Events of partial-prefix groups (sliding window, Mamba) are
  counted and otherwise ignored — also the removals of a ``group_idx`` once seen with such a kind.
  The simpler rule over-credits only when a partial group evicted blocks the full group kept; a
  model with partial groups only is never credited (no false positive).
- unknown ``medium`` names: at most ``MAX_TIERS`` tier ids in all; per worker at most
  ``MAX_UNKNOWN_MEDIUMS`` names are counted by name (the rest as one ``OTHER`` count), and the
  counts go with the worker.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import msgspec

from indexer.events import (
    CANONICAL_TIERS,
    FULL_PREFIX_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
)
from indexer.hashing import (
    chain_hashes,
    chain_hashes_extra,
    namespace_keys,
    namespace_seed,
    request_seed,
)
from indexer.rechunk import RechunkTable

__all__ = [
    "SGLANG_ROOT_PARENT",
    "IndexError_",
    "MatchResult",
    "PrefixIndex",
    "SnapshotError",
    "WorkerIndexStats",
    "WorkerKey",
    "WorkerMatch",
]

WorkerKey = tuple[str, int]

#: SGLang 0.4.9 sends ``hash(())`` as the parent of a page hanging off the radix root.
SGLANG_ROOT_PARENT = 5740354900026072187

#: Bits of a per-(block, worker) tier mask kept in a packed table value; tier i is bit i.
_TIER_BITS = 16
_MAX_TIERS = _TIER_BITS
#: Distinct unknown ``medium`` names counted by name per worker; more are counted as ``OTHER``.
MAX_UNKNOWN_MEDIUMS = 32


class IndexError_(Exception):
    """Base class of the index's own errors (named to avoid shadowing the builtin)."""


class SnapshotError(IndexError_):
    """A snapshot file that cannot be loaded: wrong format, version or block size."""


class WorkerMatch(msgspec.Struct, frozen=True):
    matched_blocks: int
    by_tier: dict[str, int]
    predicted_blocks: int = 0


class MatchResult(msgspec.Struct, frozen=True):
    request_blocks: int
    workers: dict[WorkerKey, WorkerMatch]


@dataclass
class WorkerIndexStats:
    """Counters of one worker rank; ``blocks_by_tier`` counts engine blocks per tier."""

    blocks_by_tier: dict[str, int] = field(default_factory=dict)
    stored_events: int = 0
    removed_events: int = 0
    cleared: int = 0
    orphans: int = 0
    orphan_blocks: int = 0
    unknown_removals: int = 0
    #: Stores of a hash already held on that tier (counted; one removal each before it leaves).
    duplicate_stores: int = 0
    #: Events of partial-prefix KV cache groups (sliding window, Mamba): counted, not applied.
    partial_group_events: int = 0
    #: Events with an unknown ``medium``, by name (bounded, see ``MAX_UNKNOWN_MEDIUMS``).
    unknown_mediums: dict[str, int] = field(default_factory=dict)


class _Worker:
    __slots__ = (
        "bit",
        "dups",
        "emask",
        "key",
        "model",
        "multi",
        "page",
        "partial_groups",
        "rechunk",
        "slot",
        "stats",
        "table",
        "tier_counts",
    )

    def __init__(self, key: WorkerKey, slot: int, model: str) -> None:
        self.key = key
        self.slot = slot
        self.bit = 1 << slot
        self.model = model
        # engine hash -> router hash. The router hash object is also the global map's key when
        # this worker brought the block in, so a GPU-only entry costs one dict slot and one int.
        self.table: dict[EngineHash, int] = {}
        # engine hash -> its tier mask, only for blocks not held on GPU alone (mask != 1)
        self.emask: dict[EngineHash, int] = {}
        # router hash -> {engine hash | None: tier mask} for the rare router block that several
        # engine blocks of this worker map to (same tokens, different cache salt or extra keys).
        # ``None`` stands for the engine blocks that held it before the collision was seen.
        self.multi: dict[int, dict[EngineHash | None, int]] = {}
        self.rechunk: RechunkTable | None = None
        self.tier_counts: list[int] = [0] * _MAX_TIERS
        self.stats = WorkerIndexStats()
        #: engine hash -> {tier: stores beyond the first}, for hashes stored more than once
        self.dups: dict[EngineHash, dict[int, int]] = {}
        #: the engine's page size in tokens when it differs from the router block size, else 0
        self.page = 0
        #: group_idx values seen with a partial-prefix kv_cache_spec_kind
        self.partial_groups: set[int] = set()


_ZERO = WorkerMatch(0, {})


class PrefixIndex:
    """Global prefix index over every worker rank. See the module docstring."""

    def __init__(self, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._workers: dict[WorkerKey, _Worker] = {}
        self._by_slot: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._all_bits = 0
        self._keys_cache: list[WorkerKey] | None = None
        #: slot -> engine page size, for workers whose credit rounds down to whole pages
        self._paged: dict[int, int] = {}
        self._present: dict[int, int] = _new_present()
        # slots holding a block on no GPU tier at all, and per lower tier the slots holding it
        self._nogpu: dict[int, int] = {}
        self._low: list[dict[int, int]] = [{} for _ in range(_MAX_TIERS)]
        self._tier_names: list[str] = list(CANONICAL_TIERS)
        self._tier_ids: dict[str, int] = {n: i for i, n in enumerate(CANONICAL_TIERS)}
        #: Tiers outside the canonical four that were seen (scored like EXTERNAL).
        self.unknown_tiers: dict[str, int] = {}

    # ---------------------------------------------------------------- workers

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
        w = _Worker(key, slot, model)
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

    # ---------------------------------------------------------------- events

    def apply_batch(self, worker_id: str, batch: EventBatch, *, dp_rank: int | None = None) -> None:
        rank = dp_rank if dp_rank is not None else (batch.dp_rank or 0)
        w = self._workers.get((worker_id, rank))
        if w is None:
            model = next((x.model for k, x in self._workers.items() if k[0] == worker_id), "")
            self.add_worker(worker_id, rank, model=model)
            w = self._workers[(worker_id, rank)]
        bs = self.block_size
        for ev in batch.events:
            # The common shapes (a plain GPU store chaining from a known parent, a GPU removal
            # of blocks stored once) go straight to the C hot paths; everything else, and any
            # remainder, to the general path.
            if type(ev) is BlockStored:
                if (
                    ev.tier == "GPU"
                    and ev.block_size == bs
                    and ev.extra_keys is None
                    and ev.kv_cache_spec_kind is None
                    and not w.multi
                ):
                    hashes = ev.block_hashes
                    parent = ev.parent_block_hash
                    if parent is None:
                        ph: int | None = self._seed(w, ev.lora_name, ev.lora_id)
                    else:
                        ph = w.table.get(parent)
                    if ph is not None and type(hashes) is list:
                        done = _store_gpu(
                            w.table, self._present, w.bit, hashes, 0, ev.token_ids, bs, ph
                        )
                        w.tier_counts[0] += done
                        w.stats.stored_events += 1
                        if done < len(hashes):
                            self._store(w, ev, done)
                        continue
            elif (
                type(ev) is BlockRemoved
                and ev.tier == "GPU"
                and not w.multi
                and not w.partial_groups
                and (not w.dups or w.dups.keys().isdisjoint(ev.block_hashes))
            ):
                hashes = ev.block_hashes
                if type(hashes) is list:
                    w.stats.removed_events += 1
                    self._remove(w, hashes, 0)
                    continue
            self._apply(w, ev)

    def apply_event(self, key: WorkerKey, event: Event) -> None:
        if key not in self._workers:
            self.add_worker(*key)
        self._apply(self._workers[key], event)

    def _apply(self, w: _Worker, ev: Event) -> None:
        if type(ev) is BlockStored:
            if ev.kv_cache_spec_kind not in FULL_PREFIX_KINDS:
                w.partial_groups.add(ev.group_idx)
                w.stats.partial_group_events += 1
                return
            w.stats.stored_events += 1
            if ev.block_size == self.block_size:
                self._store(w, ev)
            else:
                self._set_page(w, ev.block_size)
                self._rechunk_table(w).store(ev)
        elif type(ev) is BlockRemoved:
            if ev.group_idx in w.partial_groups:
                w.stats.partial_group_events += 1
                return
            w.stats.removed_events += 1
            hashes = ev.block_hashes
            self._remove(
                w, hashes if type(hashes) is list else list(hashes), self._tier_id(ev.tier, w)
            )
        elif type(ev) is AllBlocksCleared:
            self._drop_entries(w)
            w.stats.cleared += 1

    def _set_page(self, w: _Worker, page: int) -> None:
        """Record the engine's page size: credit on this worker is rounded down to whole pages."""
        if page == w.page:
            return
        w.page = page
        bs = self.block_size
        if page > bs or bs % page:
            self._paged[w.slot] = page
        else:
            self._paged.pop(w.slot, None)

    def _remove(self, w: _Worker, hashes: list[EngineHash], t: int) -> None:
        i, n = 0, len(hashes)
        dups = w.dups
        while i < n:
            if t == 0 and not w.multi and not dups:
                # Hot path: GPU-only blocks leave; only the presence map changes.
                stop = _remove_gpu(w.table, w.emask, self._present, ~w.bit, hashes, i)
                w.tier_counts[0] -= stop - i
                i = stop
                if i == n:
                    break
            e = hashes[i]
            d = dups.get(e) if dups else None
            if d is not None and t in d:
                # stored more than once on this tier: one copy goes, the block stays
                if d[t] > 1:
                    d[t] -= 1
                else:
                    del d[t]
                    if not d:
                        del dups[e]
            elif e in w.table:
                self._remove_tier(w, e, t)
            elif w.rechunk is not None and e in w.rechunk.blocks:
                w.rechunk.remove(e, t)
            else:
                w.stats.unknown_removals += 1
            i += 1

    def _dup(self, w: _Worker, e: EngineHash, t: int) -> None:
        """Another store of ``e`` on tier ``t``, which already holds it."""
        d = w.dups.get(e)
        if d is None:
            d = w.dups[e] = {}
        d[t] = d.get(t, 0) + 1
        w.stats.duplicate_stores += 1

    def _tier_id(self, name: str, w: _Worker | None = None) -> int:
        t = self._tier_ids.get(name)
        if t is None:
            # New unknown medium: its own tier while bits remain, then the last one shared, and
            # then the name is not kept (a publisher may send any number of names).
            t = len(self._tier_names)
            if t >= _MAX_TIERS:
                t = _MAX_TIERS - 1
            else:
                self._tier_names.append(name)
                self._tier_ids[name] = t
        if t >= len(CANONICAL_TIERS):
            if name in self.unknown_tiers or len(self.unknown_tiers) < _MAX_TIERS:
                self.unknown_tiers[name] = self.unknown_tiers.get(name, 0) + 1
            if w is not None:
                um = w.stats.unknown_mediums
                if name not in um and len(um) >= MAX_UNKNOWN_MEDIUMS:
                    name = "OTHER"
                um[name] = um.get(name, 0) + 1
        return t

    def _seed(self, w: _Worker, lora_name: str | None, lora_id: int | None) -> int:
        if lora_name is None and lora_id is not None:
            lora_name = f"lora-id:{lora_id}"
        return namespace_seed(w.model, lora_name)

    def _store(self, w: _Worker, ev: BlockStored, start: int = 0) -> None:
        """Apply a store from block ``start`` on (the ones before it were just stored by the
        caller's hot path)."""
        t = self._tier_id(ev.tier, w)
        bit = 1 << t
        table = w.table
        hashes = ev.block_hashes
        extras = None
        if ev.extra_keys is not None:
            ek = ev.extra_keys
            extras = [
                namespace_keys(ek[j] if j < len(ek) else None, ev.lora_name, ev.lora_id)
                for j in range(len(hashes))
            ]
            if not any(extras):
                extras = None
        # Blocks this worker already announced (a lower-tier copy, a load-back): add the tier.
        first_new = start
        while first_new < len(hashes) and hashes[first_new] in table:
            self._add_tier(w, hashes[first_new], bit, t)
            first_new += 1
        if first_new == len(hashes):
            return
        if first_new:
            parent_h = table[hashes[first_new - 1]]
        else:
            parent = ev.parent_block_hash
            if parent is None:
                parent_h = self._seed(w, ev.lora_name, ev.lora_id)
            elif parent in table:
                parent_h = table[parent]
            elif w.rechunk is not None and parent in w.rechunk.blocks:
                w.stats.orphans += 1
                w.stats.orphan_blocks += len(hashes)
                return
            elif parent == SGLANG_ROOT_PARENT:
                parent_h = self._seed(w, ev.lora_name, ev.lora_id)
            else:
                # Cannot chain without the parent's router hash: never guess.
                w.stats.orphans += 1
                w.stats.orphan_blocks += len(hashes) - first_new
                return
        bs = self.block_size
        tokens = ev.token_ids
        if first_new:
            tokens = tokens[first_new * bs :]
        n_full = min(len(hashes), first_new + len(tokens) // bs)
        if n_full < len(hashes):
            # token ids missing for the tail: those blocks cannot be chained
            w.stats.orphans += 1
            w.stats.orphan_blocks += len(hashes) - n_full
        i = first_new
        if t == 0 and not w.multi and extras is None:
            # Hot path (a GPU store on a worker with no colliding router blocks): only the
            # presence map changes. Stops at the first block that needs the general path.
            if type(hashes) is not list:
                hashes = list(hashes)
            i = _store_gpu(table, self._present, w.bit, hashes, i, tokens, bs, parent_h)
            w.tier_counts[0] += i - first_new
            if i == n_full:
                return
            if i > first_new:
                parent_h = table[hashes[i - 1]]
                tokens = tokens[(i - first_new) * bs :]
        if extras is None:
            router = chain_hashes(tokens, bs, parent_h)
        else:
            router = chain_hashes_extra(tokens, bs, parent_h, extras[i:])
        emask = w.emask
        for e, h in zip(hashes[i:n_full], router):
            if e in table:  # the same engine hash twice in one event, or a re-store
                self._add_tier(w, e, bit, t)
                continue
            table[e] = h
            if bit != 1:
                emask[e] = bit
            w.tier_counts[t] += 1
            self._router_add(w, h, e, bit)

    def _add_tier(self, w: _Worker, e: EngineHash, bit: int, t: int) -> None:
        own = w.emask.get(e, 1)
        if own & bit:
            self._dup(w, e, t)
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

    def _router_add(self, w: _Worker, h: int, e: EngineHash, bit: int) -> None:
        multi = w.multi.get(h)
        if multi is not None:
            old = _or_all(multi)
            multi[e] = bit
            self.set_mask(w, h, old, old | bit)
            return
        if self._present.get(h, 0) & w.bit:
            # Another engine block of this worker already maps to h (same tokens, different
            # cache salt or extra keys). Before this moment exactly one did, so ``None`` names
            # that one block precisely: its later updates find no key of their own and use it.
            old = self.worker_mask(w, h)
            w.multi[h] = {None: old, e: bit}
            self.set_mask(w, h, old, old | bit)
            return
        self.set_mask(w, h, 0, bit)

    def _remove_tier(self, w: _Worker, e: EngineHash, t: int) -> None:
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

    def _rechunk_table(self, w: _Worker) -> RechunkTable:
        if w.rechunk is None:
            w.rechunk = RechunkTable(self, w)
        return w.rechunk

    def _drop_entries(self, w: _Worker) -> None:
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
        w.tier_counts = [0] * _MAX_TIERS

    # ---------------------------------------------------------------- global masks

    def worker_mask(self, w: _Worker, h: int) -> int:
        """Tier mask of router block ``h`` on worker ``w`` as the global tables hold it."""
        bit = w.bit
        if not self._present.get(h, 0) & bit:
            return 0
        mask = 0 if self._nogpu.get(h, 0) & bit else 1
        for t in range(1, len(self._tier_names)):
            if self._low[t].get(h, 0) & bit:
                mask |= 1 << t
        return mask

    def set_mask(self, w: _Worker, h: int, old: int, new: int) -> None:
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

    # ---------------------------------------------------------------- queries

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
        return _MAX_TIERS if t is None else t

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
        if self._nogpu or (pools and self._low[3]):
            return self._match_general(hashes, overlay, pools)
        if overlay:
            # predictions too: the same C walk with the overlay (up to 64 slots), else per run
            if _walk_overlay is not None and type(overlay) is dict:
                if type(hashes) is not list:
                    hashes = list(hashes)
                r = _walk_overlay(
                    self._present, overlay, hashes, self._all_bits, len(self._by_slot)
                )
                if r is not None:
                    return self._result(len(hashes), r[0], r[1])
            return self._match_overlay(hashes, overlay)
        # GPU-only holders and nothing to overlay: the walk is a C loop over the blocks.
        if type(hashes) is not list:
            hashes = list(hashes)
        lengths, _ = _walk_lengths(self._present, hashes, self._all_bits, len(self._by_slot))
        return self._result(len(hashes), lengths)

    def _match_overlay(self, hashes: Sequence[int], overlay: Mapping[int, int]) -> MatchResult:
        """GPU-only holders plus predictions: predictions are recorded as chain segments, so
        along a request the (held, predicted) pair changes rarely and the work is per run."""
        alive = self._all_bits
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
        alive = self._all_bits
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
        shared[0] = _ZERO
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
            keys = self._slot_keys()
            return MatchResult(n, dict(zip(keys, map(shared.__getitem__, lengths))))
        return MatchResult(
            n, {w.key: shared[lengths[w.slot]] for w in self._by_slot if w is not None}
        )

    def _slot_keys(self) -> list[WorkerKey]:
        keys = self._keys_cache
        if keys is None:
            keys = self._keys_cache = [w.key for w in self._by_slot if w is not None]
        return keys

    def _build(
        self, n: int, pos: int, ended: dict[int, int], counts: dict[int, dict[int, int]]
    ) -> MatchResult:
        workers: dict[WorkerKey, WorkerMatch] = {}
        shared: dict[int, WorkerMatch] = {0: _ZERO}
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
        ext = self._low[3]
        if pools and ext:
            pool_masks = [m for m in map(self._pool_mask, pools) if m]
            exts = list(map(ext.get, hashes))
            if pool_masks and exts.count(None) != n:
                j3 = index_of[3]
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
        return [t for t in range(1, len(self._tier_names)) if t == 3 or self._low[t]]

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

    def block_tiers(self, key: WorkerKey, hashes: Sequence[int]) -> list[frozenset[str]]:
        """Tiers holding each leading block of ``hashes`` on one worker, up to the first gap."""
        w = self._workers[key]
        out: list[frozenset[str]] = []
        for h in hashes:
            mask = self.worker_mask(w, h)
            if not mask:
                break
            out.append(frozenset(self._tier_names[t] for t in range(_MAX_TIERS) if mask >> t & 1))
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
            for t in range(_MAX_TIERS):
                if mask >> t & 1:
                    out.setdefault(self._tier_names[t], set()).add(e)
        return out

    # ---------------------------------------------------------------- snapshot

    def snapshot(self, path: str | os.PathLike[str], seqs: Mapping[WorkerKey, int]) -> None:
        """Write the index and each worker's last applied seq; atomic (write + rename)."""
        from indexer.snapshot import write_snapshot

        write_snapshot(self, path, seqs)

    @classmethod
    def restore(cls, path: str | os.PathLike[str]) -> tuple[PrefixIndex, dict[WorkerKey, int]]:
        from indexer.snapshot import read_snapshot

        return read_snapshot(cls, path)


def _py_store_gpu(
    table: dict[EngineHash, int],
    present: dict[int, int],
    wbit: int,
    hashes: list[EngineHash],
    start: int,
    tokens: Sequence[int],
    block_size: int,
    parent: int,
) -> int:
    """Python twin of ``indexer._chash.store_gpu``: GPU-store blocks from ``start`` until one
    is already known or collides with another engine block of this worker; return where it stopped."""
    n = min(len(hashes), start + len(tokens) // block_size)
    router = chain_hashes(tokens[: (n - start) * block_size], block_size, parent)
    i = start
    for e, h in zip(hashes[start:n], router):
        if e in table:
            break
        m = present.get(h, 0)
        if m & wbit:
            break
        table[e] = h
        present[h] = m | wbit
        i += 1
    return i


def _py_remove_gpu(
    table: dict[EngineHash, int],
    emask: dict[EngineHash, int],
    present: dict[int, int],
    keep: int,
    hashes: list[EngineHash],
    start: int,
) -> int:
    """Python twin of ``indexer._chash.remove_gpu``: drop GPU-only blocks from ``start`` until
    one needs the general path; return where it stopped."""
    i = start
    for e in hashes[start:]:
        h = table.get(e)
        if h is None or e in emask or h not in present:
            break
        m = present[h] & keep
        if m:
            present[h] = m
        else:
            del present[h]
        del table[e]
        i += 1
    return i


try:
    from indexer._chash import MaskMap as _MaskMap
    from indexer._chash import remove_gpu as _remove_gpu
    from indexer._chash import store_gpu as _store_gpu
except ImportError:  # pragma: no cover - only where the extension could not be built
    _MaskMap = None
    _store_gpu = _py_store_gpu
    _remove_gpu = _py_remove_gpu


def _new_present() -> dict[int, int]:
    """The router hash -> slot mask table: the C ``MaskMap`` (one cache line per lookup, no int
    object per key; dict-like, typed as the dict it stands for) where built, else a dict. The C
    hot paths need the former; the Python twins take either."""
    if _MaskMap is None:
        return {}
    return _MaskMap(random.getrandbits(64))


def _py_walk_lengths(
    present: dict[int, int], hashes: list[int], alive: int, nslots: int
) -> tuple[list[int], int]:
    """Python twin of ``indexer._chash.walk_lengths``."""
    lengths = [0] * nslots
    pos = 0
    for p, grp in groupby(map(present.get, hashes)):
        if not p:
            break
        dead = alive & ~p
        alive &= p
        for slot in range(nslots):
            if dead >> slot & 1:
                lengths[slot] = pos
        if not alive:
            break
        pos += len(list(grp))
    for slot in range(nslots):
        if alive >> slot & 1:
            lengths[slot] = pos
    return lengths, pos


try:
    from indexer._chash import walk_lengths as _walk_lengths
    from indexer._chash import walk_overlay as _walk_overlay
except ImportError:  # pragma: no cover - only where the extension could not be built
    _walk_lengths = _py_walk_lengths
    _walk_overlay = None


def _end_slots(alive: int, present: int, ended: dict[int, int], pos: int) -> int:
    """The slots of ``alive`` missing from ``present`` end their match at ``pos``; the rest."""
    dead = alive & ~present
    while dead:
        lowbit = dead & -dead
        ended[lowbit.bit_length() - 1] = pos
        dead ^= lowbit
    return alive & present


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
