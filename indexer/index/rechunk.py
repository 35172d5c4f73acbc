"""Re-chunking: workers whose engine page size differs from the router block size.

SGLang's default page size is 1, vLLM's is 16, others use 32 or 64, while the router hashes one
block size per model. A router block is present on such a worker when every engine block covering
its tokens is present; its tiers are those all covering blocks share, or else the slowest of their
fastest tiers (docs/architecture.md §3). Each engine block keeps the router chain state at the last router-block
boundary before its end plus the tokens after it, so a child store can continue the chain.

A ``RechunkTable`` is created by the applier on a worker's first such store and hangs off the
worker (``RankRecord.rechunk``); it changes the global masks through ``IndexState.set_mask`` only.
"""

from __future__ import annotations

from indexer.events import BlockStored, EngineHash
from indexer.hashing import chain_hashes, extra_seed, namespace_keys
from indexer.index.state import IndexState
from indexer.index.types import MAX_TIERS, SGLANG_ROOT_PARENT, RankRecord

__all__ = ["RechunkTable"]


class _EBlock:
    __slots__ = ("end", "parent", "routers", "state", "tail", "tiers")

    def __init__(
        self, parent: EngineHash | None, tiers: int, end: int, state: int, tail: tuple[int, ...]
    ) -> None:
        self.parent = parent
        self.tiers = tiers
        self.end = end  # token depth at the end of this block
        self.state = state  # router hash of the last full router block at or before ``end``
        self.tail = tail  # tokens after that boundary
        self.routers: list[int] = []  # router blocks this engine block helps cover


class RechunkTable:
    """One worker rank's engine blocks when ``event.block_size != index.block_size``."""

    def __init__(self, index: IndexState, worker: RankRecord) -> None:
        self.index = index
        self.worker = worker
        self.blocks: dict[EngineHash, _EBlock] = {}
        self.cover: dict[int, list[EngineHash]] = {}
        self.rmask: dict[int, int] = {}
        self.tier_counts = [0] * MAX_TIERS

    def store(self, ev: BlockStored) -> None:
        index, w = self.index, self.worker
        t = index.tier_id(ev.tier, w)
        bit = 1 << t
        p = ev.block_size
        if p <= 0:
            w.stats.orphans += 1
            return
        toks = ev.token_ids
        ek = ev.extra_keys
        parent: EngineHash | None = ev.parent_block_hash
        for i, e in enumerate(ev.block_hashes):
            eb = self.blocks.get(e)
            if eb is not None:
                if eb.tiers & bit:
                    index.count_dup(w, e, t)
                else:
                    self._add_tier(eb, bit, t)
                parent = e
                continue
            tail: tuple[int, ...]
            if parent is None or (parent not in self.blocks and parent == SGLANG_ROOT_PARENT):
                pe = None
                end0, state, tail = 0, w.seed(ev.lora_name, ev.lora_id), ()
            else:
                pe = self.blocks.get(parent)
                if pe is None:
                    w.stats.orphans += 1
                    w.stats.orphan_blocks += len(ev.block_hashes) - i
                    return
                end0, state, tail = pe.end, pe.state, pe.tail
            block_toks = toks[i * p : (i + 1) * p]
            if len(block_toks) < p:
                w.stats.orphans += 1
                w.stats.orphan_blocks += len(ev.block_hashes) - i
                return
            if ek is not None:
                keys = namespace_keys(ek[i] if i < len(ek) else None, ev.lora_name, ev.lora_id)
                if keys:
                    state = extra_seed(state, keys)  # another namespace from here on (hashing)
            buf = [*tail, *block_toks]
            bs = index.block_size
            new = chain_hashes(buf, bs, state)
            k = len(new)
            eb = _EBlock(
                parent if pe is not None else None,
                bit,
                end0 + p,
                new[-1] if k else state,
                tuple(buf[k * bs :]),
            )
            self.blocks[e] = eb
            self.tier_counts[t] += 1
            base = eb.end - len(buf)
            for j, h in enumerate(new):
                if h in self.cover:
                    continue  # same router block through another engine chain: keep the first
                start = base + j * bs
                cov = [e]
                a = eb.parent
                while a is not None:
                    ab = self.blocks.get(a)
                    if ab is None or ab.end <= start:
                        break
                    cov.append(a)
                    a = ab.parent
                self.cover[h] = cov
                for c in cov:
                    self.blocks[c].routers.append(h)
                self._recompute(h)
            parent = e

    def remove(self, e: EngineHash, t: int) -> None:
        eb = self.blocks[e]
        bit = 1 << t
        if not eb.tiers & bit:
            self.worker.stats.unknown_removals += 1
            return
        eb.tiers &= ~bit
        self.tier_counts[t] -= 1
        for h in eb.routers:
            self._recompute(h)
        if not eb.tiers:
            self._collect(e, eb)

    def evict(self, e: EngineHash) -> None:
        """Drop engine block ``e`` from every tier at once (a cap's eviction)."""
        eb = self.blocks[e]
        if not eb.tiers:
            return
        m, t = eb.tiers, 0
        while m:
            if m & 1:
                self.tier_counts[t] -= 1
            m >>= 1
            t += 1
        eb.tiers = 0
        for h in eb.routers:
            self._recompute(h)
        self._collect(e, eb)

    def renew(self, e: EngineHash) -> None:
        """Move ``e`` to the back of the eviction order (it was used)."""
        self.blocks[e] = self.blocks.pop(e)

    def load_block(
        self,
        e: EngineHash,
        parent: EngineHash | None,
        tiers: int,
        end: int,
        state: int,
        tail: tuple[int, ...],
    ) -> None:
        """Restore one engine block from a snapshot (then ``load_cover`` its router blocks)."""
        self.blocks[e] = _EBlock(parent, tiers, end, state, tail)
        for t in range(MAX_TIERS):
            if tiers >> t & 1:
                self.tier_counts[t] += 1

    def load_cover(self, h: int, cov: list[EngineHash]) -> None:
        """Restore which engine blocks cover router block ``h``, and its mask in the state."""
        self.cover[h] = cov
        for c in cov:
            if c in self.blocks:
                self.blocks[c].routers.append(h)
        self._recompute(h)

    def _add_tier(self, eb: _EBlock, bit: int, t: int) -> None:
        if eb.tiers & bit:
            return
        eb.tiers |= bit
        self.tier_counts[t] += 1
        for h in eb.routers:
            self._recompute(h)

    def _recompute(self, h: int) -> None:
        held = True
        inter = -1
        slowest = 0
        for c in self.cover[h]:
            cb = self.blocks.get(c)
            m = cb.tiers if cb is not None else 0
            if not m:
                held = False
                break
            inter &= m
            slowest = max(slowest, (m & -m).bit_length() - 1)
        new = (inter or 1 << slowest) if held else 0
        old = self.rmask.get(h, 0)
        if new:
            self.rmask[h] = new
        else:
            self.rmask.pop(h, None)
        self.index.set_mask(self.worker, h, old, new)

    def _collect(self, e: EngineHash, eb: _EBlock) -> None:
        """Forget router blocks none of whose engine blocks is held, then engine blocks no
        router block needs (``e`` and the others of those router blocks: an engine evicting
        leaves first empties a router block's blocks before its last one goes). A held child
        keeps its (empty) ancestors so a re-store of them brings the router blocks they cover
        back."""
        for h in list(eb.routers):
            cov = self.cover[h]
            if all(not self.blocks[c].tiers for c in cov if c in self.blocks):
                del self.cover[h]
                for c in cov:
                    cb = self.blocks.get(c)
                    if cb is not None:
                        cb.routers.remove(h)
                        if c != e and not cb.tiers and not cb.routers:
                            del self.blocks[c]
        if not eb.tiers and not eb.routers:
            del self.blocks[e]
