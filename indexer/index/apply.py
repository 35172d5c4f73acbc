"""Applying events to the index state: the one entry point ``apply_batch`` (and ``apply_event``
for tests and tools), called only by the subscriber task. ``Applier`` turns events into the
state's entry operations (``IndexState.add_block``/``add_tier``/``remove_tier``/...) and runs the
common shapes through the C store/remove loops (``indexer.index.native``).

What the engine can really reuse (issue 12):

- duplicate stores: an engine may store one hash twice (vLLM recomputes a fully cached prompt's
  last page into a second physical block) and remove it once. Stores are counted per (worker,
  engine hash, tier); the block leaves a tier when its count reaches 0.
- page size: a worker whose events carry ``block_size`` P (its page) is credited whole pages only
  (``IndexState.set_page``; the rounding is in ``indexer.index.match``); other page sizes are
  re-chunked (``indexer.index.rechunk``).
- extra keys: a block whose ``extra_keys`` (after the LoRA key) are not empty chains from
  ``hashing.extra_seed``: another namespace for salted and multimodal blocks.
- hybrid models: presence follows the groups whose ``kv_cache_spec_kind`` keeps the whole prefix
  (``events.FULL_PREFIX_KINDS``). Events of partial-prefix groups (sliding window, Mamba) are
  counted and otherwise ignored, also the removals of a ``group_idx`` once seen with such a kind.
  This simpler rule over-credits only when a partial group evicted blocks the full group kept; a
  model with partial groups only is never credited (no false positive).
"""

from __future__ import annotations

from collections.abc import Callable

from indexer.events import (
    FULL_PREFIX_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
)
from indexer.hashing import chain_hashes, chain_hashes_extra, namespace_keys
from indexer.index.native import remove_gpu as _remove_gpu
from indexer.index.native import store_gpu as _store_gpu
from indexer.index.rechunk import RechunkTable
from indexer.index.state import IndexState
from indexer.index.types import SGLANG_ROOT_PARENT, PagedBlocks, RankRecord, WorkerKey

__all__ = ["Applier"]


class Applier:
    """The index's writer side, over one ``IndexState``."""

    def __init__(self, state: IndexState) -> None:
        self._state = state
        # Bound once: the per-event paths use them without going through ``self._state``
        # (the state mutates these containers in place, never rebinds them).
        self._workers = state.by_key
        self._present = state.present
        self.block_size = state.block_size
        self._tier_id = state.tier_id
        self._add_block = state.add_block
        self._add_tier = state.add_tier
        self._remove_tier = state.remove_tier
        #: Called with a rank past ``RankRecord.cap`` after its batch (the evictor's, see
        #: ``indexer.index.evict``); returns the entries it evicted.
        self.over_cap: Callable[[RankRecord], int] = lambda w: 0

    def apply_batch(self, worker_id: str, batch: EventBatch, *, dp_rank: int | None = None) -> None:
        rank = dp_rank if dp_rank is not None else (batch.dp_rank or 0)
        w = self._workers.get((worker_id, rank))
        if w is None:
            model = next((x.model for k, x in self._workers.items() if k[0] == worker_id), "")
            self._state.add_worker(worker_id, rank, model=model)
            w = self._workers[(worker_id, rank)]
        if w.approximate:
            # scored from what the router sent it (the closed loop distrusts its events for
            # now): its events would mix engine-announced blocks into that guess
            return
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
                        ph: int | None = w.seed(ev.lora_name, ev.lora_id)
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
        self._count(w)

    def apply_event(self, key: WorkerKey, event: Event) -> None:
        if key not in self._workers:
            self._state.add_worker(*key)
        w = self._workers[key]
        if w.approximate:  # (as ``apply_batch``)
            return
        self._apply(w, event)
        self._count(w)

    def _count(self, w: RankRecord) -> None:
        """After a batch: the rank's entries into the running total, and past ``w.cap`` (where
        it nears its cap) to the evictor."""
        n = w.entries()
        self._state.counted_total += n - w.counted
        w.counted = n
        if w.cap and n > w.cap:
            self.over_cap(w)

    def _apply(self, w: RankRecord, ev: Event) -> None:
        if type(ev) is BlockStored:
            if ev.kv_cache_spec_kind not in FULL_PREFIX_KINDS:
                w.partial_groups.add(ev.group_idx)
                w.stats.partial_group_events += 1
                return
            w.stats.stored_events += 1
            if ev.block_size == self.block_size:
                self._store(w, ev)
            else:
                self._state.set_page(w, ev.block_size)
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
            self._state.drop_entries(w)
            w.stats.cleared += 1

    def _remove(self, w: RankRecord, hashes: list[EngineHash], t: int) -> None:
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

    def _store(self, w: RankRecord, ev: BlockStored, start: int = 0) -> None:
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
                parent_h = w.seed(ev.lora_name, ev.lora_id)
            elif parent in table:
                parent_h = table[parent]
            elif w.rechunk is not None and parent in w.rechunk.blocks:
                w.stats.orphans += 1
                w.stats.orphan_blocks += len(hashes)
                return
            elif parent == SGLANG_ROOT_PARENT:
                parent_h = w.seed(ev.lora_name, ev.lora_id)
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
            self._add_block(w, h, e, bit)

    def _rechunk_table(self, w: RankRecord) -> PagedBlocks:
        if w.rechunk is None:
            w.rechunk = RechunkTable(self._state, w)
        return w.rechunk
