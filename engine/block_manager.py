"""The GPU block pool: paged blocks, the prefix cache over them, ref counts and the LRU free queue.

vLLM's scheme (v1 ``KVCacheManager``/``BlockPool``), small:

* every full block of a sequence gets a chained 64-bit *engine* hash
  ``h_i = blake2b(h_{i-1} || tokens_i)`` seeded by the runner's KV fingerprint. It is this
  engine's own key (the router rebuilds its own hash from the token ids of each ``BlockStored``);
  engines with the same model and layout compute the same keys, which is what lets them share
  the EXTERNAL pool.
* a block whose KV is computed (or loaded back) and whose parent is cached is registered in
  ``hash → block``: that is the moment ``BlockStored(GPU)`` is published. One block per hash: a
  second sequence that computed the same block keeps its copy private.
* freed blocks keep their hash and go to the tail of the free queue, a sequence's blocks in
  reverse order so its tail is evicted before its head; allocation pops the head (least recently
  used), and only then is the hash dropped (``BlockRemoved(GPU)``), after ``evict_hook`` had the
  chance to copy the block to a lower tier (write-back).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.kv_events import EventLog
from engine.sequence import Sequence

__all__ = [
    "Block",
    "BlockManager",
    "NoFreeBlocksError",
    "engine_block_hash",
    "hash_chain",
    "hash_seed",
]


class NoFreeBlocksError(RuntimeError):
    """Allocation asked for more blocks than the free queue holds (a scheduler bug)."""


def hash_seed(fingerprint: str) -> int:
    """Root parent of every chain: engines with equal KV fingerprints share keys."""
    return int.from_bytes(hashlib.blake2b(fingerprint.encode(), digest_size=8).digest(), "big")


def engine_block_hash(parent: int, token_ids: Seq[int]) -> int:
    """Unsigned 64-bit chained hash of one full block."""
    h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "big")


def hash_chain(seed: int, token_ids: Seq[int], block_size: int) -> list[int]:
    """Engine hashes of the full blocks of ``token_ids`` from the root ``seed``."""
    parent, out = seed, []
    for i in range(len(token_ids) // block_size):
        parent = engine_block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    #: Set while the block is in the prefix cache.
    hash: int | None = None
    parent: int | None = None
    token_ids: tuple[int, ...] = field(default=())


class BlockManager:
    """Owned by the engine core thread. ``evict_hook(block)`` runs before a cached block is
    reused; ``store_hook(block)`` after a block was registered (for write-through offload)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: EventLog,
        *,
        seed: int,
        enable_caching: bool = True,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self.seed = seed
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order: first = evicted next. Values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # engine hash -> block id
        self.evict_hook: Callable[[Block], None] | None = None
        self.store_hook: Callable[[Block], None] | None = None
        self.queries = 0  # prefix-cache lookups, in tokens (vLLM's prefix_cache_queries)
        self.hits = 0  # tokens found (GPU hits and load-backs)

    # ------------------------------------------------------------------ state

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def is_cached(self, h: int) -> bool:
        return h in self._cached

    # ------------------------------------------------------------------ hashing

    def hash_blocks_of(self, token_ids: Seq[int]) -> list[int]:
        """Engine hashes of the full blocks of ``token_ids`` from the root."""
        return hash_chain(self.seed, token_ids, self.block_size)

    def hash_blocks(self, seq: Sequence) -> list[int]:
        """Extend ``seq.block_hashes`` over every full block of its tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else self.seed
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = engine_block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def parent_of(self, seq: Sequence, i: int) -> int | None:
        return seq.block_hashes[i - 1] if i > 0 else None

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, hashes: Seq[int]) -> list[int]:
        """Block ids of the longest prefix of ``hashes`` cached on GPU."""
        out: list[int] = []
        if not self.enable_caching:
            return out
        for h in hashes:
            bid = self._cached.get(h)
            if bid is None:
                break
            out.append(bid)
        return out

    def touch(self, block_ids: Seq[int]) -> None:
        """Take a reference on cached blocks (a prefix hit): they leave the free queue."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_count == 0:
                del self._free[bid]
            b.ref_count += 1

    # ------------------------------------------------------------------ allocation

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue, evicting their cached content."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            b = self.blocks[bid]
            if b.hash is not None:
                self._evict(b)
            b.ref_count = 1
            out.append(bid)
        return out

    def _evict(self, b: Block) -> None:
        if self.evict_hook is not None:
            self.evict_hook(b)
        assert b.hash is not None
        del self._cached[b.hash]
        self.events.removed("GPU", [b.hash])
        b.hash, b.parent, b.token_ids = None, None, ()

    def free_blocks(self, block_ids: Seq[int]) -> None:
        """Drop one reference on each block, last block first (tail evicted before head)."""
        for bid in reversed(block_ids):
            self.unpin(bid)

    def pin(self, bid: int) -> None:
        """Hold a block while a copy reads it (it must not be reused meanwhile)."""
        self.touch([bid])

    def unpin(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count <= 0:
            raise RuntimeError(f"block {bid} freed twice")
        b.ref_count -= 1
        if b.ref_count == 0:
            self._free[bid] = None
            if b.hash is None:  # nothing worth keeping: reuse it first
                self._free.move_to_end(bid, last=False)

    # ------------------------------------------------------------------ registration

    def register_computed(self, seq: Sequence) -> None:
        """Register the sequence's blocks whose KV is now fully computed (``BlockStored(GPU)``)."""
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        self.hash_blocks(seq)
        run: list[int] = []
        run_start = seq.num_registered_blocks
        for i in range(seq.num_registered_blocks, full):
            h = seq.block_hashes[i]
            parent = self.parent_of(seq, i)
            b = self.blocks[seq.block_table[i]]
            ok = (
                self.enable_caching
                and b.hash is None
                and h not in self._cached
                and (parent is None or parent in self._cached)
            )
            if ok:
                self._register(b, h, parent, seq.block_tokens(i, bs))
                if not run:
                    run_start = i
                run.append(h)
            else:
                self._flush_run(seq, run, run_start)
                run = []
        self._flush_run(seq, run, run_start)
        seq.num_registered_blocks = full

    def _flush_run(self, seq: Sequence, run: list[int], start: int) -> None:
        if not run:
            return
        bs = self.block_size
        tokens = seq.token_ids[start * bs : (start + len(run)) * bs]
        self.events.stored("GPU", run, self.parent_of(seq, start), tokens)
        if self.store_hook is not None:
            for h in run:
                self.store_hook(self.blocks[self._cached[h]])

    def register_loaded(self, bid: int, h: int, parent: int | None, tokens: Seq[int]) -> bool:
        """A load-back finished: the block's KV is on GPU now. False if the hash got there first
        (another sequence computed it meanwhile); the block then stays private."""
        b = self.blocks[bid]
        if h in self._cached or b.hash is not None:
            return False
        self._register(b, h, parent, tokens)
        self.events.stored("GPU", [h], parent, tokens)
        return True

    def _register(self, b: Block, h: int, parent: int | None, tokens: Seq[int]) -> None:
        b.hash, b.parent, b.token_ids = h, parent, tuple(tokens)
        self._cached[h] = b.block_id

    def reset(self) -> None:
        """Forget every hash (``AllBlocksCleared`` is the caller's to emit). Blocks in use keep
        their KV as private blocks."""
        for b in self.blocks:
            b.hash, b.parent, b.token_ids = None, None, ()
        self._cached.clear()
        free = [bid for bid in self._free]
        self._free = OrderedDict((bid, None) for bid in free)
