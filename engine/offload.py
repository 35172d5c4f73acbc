"""Moving KV between the GPU pool and the lower tiers, and publishing each move once it is true.

Policies (``--offload``):

* ``write-through``: a block registered on GPU is copied down at once: GPU → CPU_PINNED (async;
  ``BlockStored(CPU_PINNED)`` when the runner's copy reports done), then host → DISK → EXTERNAL.
  Evicting a block from a tier just drops it there (the lower tiers already hold it).
* ``write-back``: a block is copied one tier down only when it is evicted from its tier
  (GPU → CPU_PINNED → DISK → EXTERNAL, skipping absent tiers). The copy completes (the evicting
  allocation waits for it) before ``BlockStored`` of the lower tier, which comes before the upper
  tier's ``BlockRemoved``, so the index never loses a block that still exists.

A block whose parent is held by no tier is never copied down: no prefix lookup can reach it.

Load-back: :meth:`TierManager.plan` finds the longest run of blocks after a GPU hit that the
lower tiers hold; :meth:`prepare` pins host copies and stages DISK/EXTERNAL bytes into host
staging slots; :meth:`start_load` issues the swap-ins; :meth:`poll` completes loads (and pending
write-through copies) in issue order, registering loaded blocks on GPU (``BlockStored(GPU)``).
Tier errors are logged and counted; they cost cache hits, never requests.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.block_manager import Block, BlockManager
from engine.kv_events import EventLog
from engine.runner.base import DoneTransfer, ModelRunner, Transfer
from engine.tiers import BlockMeta, DiskTier, ExternalTier, HostEntry, HostPool, TierError
from engine.transfers import Delayed, LoadItem, LoadJob

__all__ = ["Delayed", "LoadItem", "LoadJob", "TierManager"]

log = logging.getLogger("engine.offload")

#: the tiers below GPU an engine loads back from (anything else came from another engine)
_OWN_TIERS = ("CPU_PINNED", "DISK", "EXTERNAL")


@dataclass
class _StoreOp:
    block_id: int
    meta: BlockMeta
    transfer: Transfer
    entry: HostEntry | None  # CPU_PINNED destination, or None for a staging slot
    slot: int


class TierManager:
    def __init__(
        self,
        runner: ModelRunner,
        bm: BlockManager,
        events: EventLog,
        *,
        host: HostPool | None,
        disk: DiskTier | None,
        external: ExternalTier | None,
        mode: str = "write-through",
        speedup: float = 1.0,
    ) -> None:
        if mode not in ("write-through", "write-back"):
            raise ValueError(f"unknown offload mode {mode!r}")
        self.runner, self.bm, self.events = runner, bm, events
        self.host, self.disk, self.external = host, disk, external
        self.mode = mode
        self.speedup = speedup
        self._ops: deque[_StoreOp | LoadJob] = deque()
        self.loaded: list[LoadJob] = []
        #: blocks loaded back to GPU, by source tier
        self.loaded_blocks: dict[str, int] = {"CPU_PINNED": 0, "DISK": 0, "EXTERNAL": 0}
        self.errors = 0
        self.skipped = 0  # copies not made (no free slot)
        if self.enabled:
            if mode == "write-through":
                bm.store_hook = self._store_through
            else:
                bm.evict_hook = self._evict_gpu

    @property
    def enabled(self) -> bool:
        return bool((self.host and self.host.capacity) or self.disk or self.external)

    @property
    def busy(self) -> bool:
        return bool(self._ops)

    def listing(self) -> dict[str, set[int]]:
        return {
            "GPU": self.bm.cached_hashes(),
            "CPU_PINNED": self.host.hashes() if self.host else set(),
            "DISK": self.disk.files() if self.disk else set(),
            "EXTERNAL": self.external.hashes() if self.external else set(),
        }

    def block_counts(self) -> dict[str, int]:
        """Blocks per tier from memory (cheap; ``listing`` reads the DISK directory)."""
        return {
            "GPU": self.bm.num_cached,
            "CPU_PINNED": self.host.num_ready if self.host else 0,
            "DISK": len(self.disk.entries) if self.disk else 0,
            "EXTERNAL": len(self.external.entries) if self.external else 0,
        }

    def held(self, h: int | None) -> bool:
        """Some tier of this engine holds ``h`` (None: the root, always held)."""
        return (
            h is None
            or self.bm.is_cached(h)
            or (self.host is not None and h in self.host.entries)
            or (self.disk is not None and h in self.disk)
            or (self.external is not None and h in self.external)
        )

    # ------------------------------------------------------------------ copies down

    def _host_slot(self, meta: BlockMeta) -> HostEntry | None:
        assert self.host is not None
        if not self.host.has_free():
            victim = self.host.victim()
            if victim is None:
                return None
            self._evict_host(victim)
        return self.host.reserve(meta)

    def _store_through(self, b: Block) -> None:
        meta = BlockMeta(b.hash or 0, b.parent, b.token_ids)
        if self.host is not None and self.host.capacity:
            if meta.hash in self.host.entries:
                self.host.touch(meta.hash)
                return
            entry = self._host_slot(meta)
            slot = entry.slot if entry else None
        else:
            entry, slot = None, self.host.take_staging() if self.host else None
        if slot is None:
            self.skipped += 1
            return
        self.bm.pin(b.block_id)
        t = self.runner.swap_out([(b.block_id, slot)])
        self._ops.append(_StoreOp(b.block_id, meta, t, entry, slot))

    def _finish_store(self, op: _StoreOp) -> None:
        self.bm.unpin(op.block_id)
        if op.entry is not None:
            assert self.host is not None
            self.host.complete(op.entry)
            self.events.stored("CPU_PINNED", [op.meta.hash], op.meta.parent, op.meta.token_ids)
        if self.held(op.meta.parent):
            self._write_lower(op.meta, op.slot, down_to_all=True)
        if op.entry is None and self.host is not None:
            self.host.give_staging(op.slot)

    def _write_lower(self, meta: BlockMeta, slot: int, *, down_to_all: bool) -> None:
        """Copy a host slot to DISK and/or EXTERNAL (all of them, or the first present)."""
        kv: bytes | None = None
        for tier in ("DISK", "EXTERNAL"):
            store = self.disk if tier == "DISK" else self.external
            if store is None:
                continue
            if meta.hash not in store:
                try:
                    kv = kv if kv is not None else self.runner.read_host(slot)
                    self._put(tier, meta, kv)
                except TierError as exc:
                    self._error(f"{tier} write", exc)
                    continue
            if not down_to_all:
                return

    def _put(self, tier: str, meta: BlockMeta, kv: bytes) -> None:
        if tier == "DISK":
            assert self.disk is not None
            if self.disk.full():
                self._evict_disk(self.disk.victim())
            self.disk.write(meta, kv)
        else:
            assert self.external is not None
            if self.external.full():
                victim = self.external.forget(self.external.victim().hash, delete=False)
                self.events.removed("EXTERNAL", [victim.hash])
            self.external.write(meta, kv)
        self.events.stored(tier, [meta.hash], meta.parent, meta.token_ids)

    def _evict_gpu(self, b: Block) -> None:
        """write-back: copy a GPU block down before the allocator reuses it."""
        meta = BlockMeta(b.hash or 0, b.parent, b.token_ids)
        lower = (
            (self.host is not None and meta.hash in self.host.entries)
            or (self.disk is not None and meta.hash in self.disk)
            or (self.external is not None and meta.hash in self.external)
        )
        if lower or not self.held(meta.parent):
            return
        host_tier = self.host is not None and self.host.capacity > 0
        entry = self._host_slot(meta) if host_tier else None
        slot = entry.slot if entry else (self.host.take_staging() if self.host else None)
        if slot is None:
            self.skipped += 1
            return
        t = self.runner.swap_out([(b.block_id, slot)])
        t.wait()
        if entry is not None:
            assert self.host is not None
            self.host.complete(entry)
            self.events.stored("CPU_PINNED", [meta.hash], meta.parent, meta.token_ids)
        else:
            self._write_lower(meta, slot, down_to_all=False)
            if self.host is not None:
                self.host.give_staging(slot)

    def _evict_host(self, e: HostEntry) -> None:
        assert self.host is not None
        if self.mode == "write-back" and self.held(e.meta.parent):
            self._write_lower(e.meta, e.slot, down_to_all=False)
        self.host.release(e.meta.hash)
        self.events.removed("CPU_PINNED", [e.meta.hash])

    def _evict_disk(self, meta: BlockMeta) -> None:
        assert self.disk is not None
        ext = self.external
        push = self.mode == "write-back" and ext is not None and meta.hash not in ext
        if push and self.held(meta.parent):
            try:
                self._put("EXTERNAL", meta, self.disk.read(meta.hash))
            except TierError as exc:
                self._error("EXTERNAL write-back", exc)
        self.disk.delete(meta.hash)
        self.events.removed("DISK", [meta.hash])

    # ------------------------------------------------------------------ load-back

    def plan(self, hashes: Sequence[int]) -> list[tuple[int, str]]:
        """The longest leading run of ``hashes`` the lower tiers hold, with the tier to read."""
        out: list[tuple[int, str]] = []
        for h in hashes:
            if self.host is not None and self.host.get(h) is not None:
                out.append((h, "CPU_PINNED"))
            elif self.disk is not None and h in self.disk:
                out.append((h, "DISK"))
            else:
                break
        if self.external is not None and len(out) < len(hashes):
            try:
                found = self.external.present(hashes[len(out) :])
            except TierError as exc:
                self._error("EXTERNAL lookup", exc)
                found = []
            for h, ok in zip(hashes[len(out) :], found):
                if not ok:
                    break
                out.append((h, "EXTERNAL"))
        return out

    def prepare(
        self, plan: Sequence[tuple[int, str]], metas: Callable[[int], BlockMeta]
    ) -> list[LoadItem]:
        """Pin host copies and stage DISK/EXTERNAL bytes. Stops early when staging runs out or a
        read fails: the rest of the prefix is recomputed."""
        items: list[LoadItem] = []
        for h, tier in plan:
            try:
                item = self._stage(h, tier, metas(h))
            except TierError as exc:
                self._error(f"{tier} read", exc)
                item = None
            if item is None:
                break
            items.append(item)
        return items

    def _stage(self, h: int, tier: str, meta: BlockMeta) -> LoadItem | None:
        assert self.host is not None
        if tier == "CPU_PINNED":
            e = self.host.get(h)
            if e is None:
                return None
            e.pins += 1
            return LoadItem(e.meta, tier, e.slot)
        if tier == "DISK":
            assert self.disk is not None
            kv = self.disk.read(h)
        else:
            assert self.external is not None
            got = self.external.read(h)
            if got is None:
                return None
            stored, kv = got
            if stored.token_ids != meta.token_ids:
                raise TierError(f"external block {h:016x} holds other tokens")
        slot = self.host.take_staging()
        if slot is None:
            return None
        try:
            self.runner.write_host(slot, kv)
        except Exception:
            self.host.give_staging(slot)
            raise
        return LoadItem(meta, tier, slot)

    def start_load(self, seq_id: int, items: list[LoadItem]) -> LoadJob:
        """Issue the swap-ins (``gpu_block`` set by the caller)."""
        job = LoadJob(seq_id, items)
        by_tier: dict[str, list[LoadItem]] = {}
        for it in items:
            by_tier.setdefault(it.tier, []).append(it)
        for tier, its in by_tier.items():
            t = self.runner.swap_in([(it.slot, it.gpu_block) for it in its])
            if tier != "CPU_PINNED":
                nbytes = len(its) * self.runner.kv_block_bytes
                t = Delayed(t, self.runner.io_delay(tier, nbytes), self.speedup)
            job.transfers.append(t)
        if not job.transfers:
            job.transfers.append(DoneTransfer())
        self._ops.append(job)
        return job

    def _finish_load(self, job: LoadJob) -> None:
        assert self.host is not None
        for it in job.items:
            self.loaded_blocks[it.tier] = self.loaded_blocks.get(it.tier, 0) + 1
            if it.tier == "CPU_PINNED":
                e = self.host.entries.get(it.meta.hash)
                if e is not None:
                    e.pins -= 1
                    self.host.touch(it.meta.hash)
            else:
                self.host.give_staging(it.slot)
            new = self.bm.register_loaded(
                it.gpu_block, it.meta.hash, it.meta.parent, it.meta.token_ids
            )
            if new and it.tier not in _OWN_TIERS and self.bm.store_hook is not None:
                # a block from outside this engine (pulled from a prefill engine): no lower
                # tier of it holds a copy, so write-through copies it down as a computed one
                self.bm.store_hook(self.bm.blocks[it.gpu_block])

    # ------------------------------------------------------------------ completion

    def poll(self, *, wait: bool = False) -> None:
        """Complete finished copies in issue order (all of them with ``wait``). Completed loads
        wait in :attr:`loaded` until the engine takes them (:meth:`take_loaded`)."""
        while self._ops:
            op = self._ops[0]
            transfers = op.transfers if isinstance(op, LoadJob) else [op.transfer]
            if wait:
                for t in transfers:
                    t.wait()
            elif not all(t.done() for t in transfers):
                break
            self._ops.popleft()
            if isinstance(op, LoadJob):
                self._finish_load(op)
                self.loaded.append(op)
            else:
                self._finish_store(op)

    def take_loaded(self) -> list[LoadJob]:
        out, self.loaded = self.loaded, []
        return out

    def clear(self) -> None:
        """For reset: finish every copy, then drop every lower-tier block (no events: the caller
        publishes ``AllBlocksCleared``)."""
        self.poll(wait=True)
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            try:
                self.disk.clear()
            except TierError as exc:
                self._error("DISK clear", exc)
        if self.external is not None:
            self.external.clear()

    def _error(self, what: str, exc: Exception) -> None:
        self.errors += 1
        log.warning("%s failed: %s", what, exc)
