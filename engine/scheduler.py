"""Continuous batching: which sequences compute how many tokens in the next step.

vLLM v1 style, one token budget per step shared by decodes and prefill chunks:

1. running sequences first (decodes and unfinished prefill chunks), in arrival order; when a
   sequence needs a block and none is free, the most recently admitted running sequence is
   preempted by recompute (its blocks freed, kept in the prefix cache, back to the waiting front);
2. then waiting sequences, first come first served, while budget, blocks and ``max_num_seqs``
   allow. Admission looks up the prefix cache on GPU; if the lower tiers hold more of the prefix,
   the sequence takes GPU blocks for it and waits in LOADING until the copies completed, then
   joins the running set with those tokens computed. A prompt whose uncached part exceeds the
   budget is prefilled in chunks over several steps.

At least one prompt token is always computed (vLLM: the last token's logits are needed), so a
fully cached prompt reuses ``(len - 1) // block_size`` blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.offload import LoadJob, TierManager
from engine.pd.kv_io import stage_blocks
from engine.sequence import RemoteKV, Sequence, SequenceStatus
from engine.tiers import BlockMeta

__all__ = ["Scheduler", "SchedulerOutput"]


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        bm: BlockManager,
        tiers: TierManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> None:
        if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        self.bm = bm
        self.tiers = tiers
        self.block_size = bm.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[int, Sequence] = {}
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        queue = list(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            need = self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            while need > self.bm.num_free_blocks and queue:
                self._preempt(queue.pop(), out)
            if need > self.bm.num_free_blocks:
                self._preempt(seq, out)
                continue
            if need > 0:
                seq.block_table.extend(self.bm.allocate(need))
            out.scheduled.append((seq, n))
            budget -= n
            kept.append(seq)
        self.running = kept
        if out.preempted:
            return out
        while self.waiting and budget > 0:
            if len(self.running) + len(self.loading) >= self.max_num_seqs:
                break
            n = self._admit(self.waiting[0], budget, out)
            if n < 0:
                break
            self.waiting.popleft()
            budget -= n
        return out

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Start a waiting sequence: tokens scheduled now (0 if it went to LOADING), -1 if it
        cannot start yet."""
        bm, bs = self.bm, self.block_size
        hashes = bm.hash_blocks(seq)
        max_hit = (seq.num_tokens - 1) // bs
        hit = bm.lookup(hashes[:max_hit])
        hit_free = sum(1 for b in hit if bm.blocks[b].ref_count == 0)
        if seq.remote_kv is not None:
            pulled = self._admit_remote(seq, hit, hit_free)
            if pulled is not None:
                return pulled
        if self.tiers.enabled and len(hit) < max_hit:
            plan = self.tiers.plan(hashes[len(hit) : max_hit])
            if plan and len(plan) + hit_free <= bm.num_free_blocks:
                index = {h: i for i, h in enumerate(hashes)}
                items = self.tiers.prepare(plan, lambda h: self._meta(seq, index[h]))
                if items:
                    bm.touch(hit)
                    for it, bid in zip(items, bm.allocate(len(items))):
                        it.gpu_block = bid
                    self._count_hit(seq, len(hit) + len(items))
                    seq.block_table = hit + [it.gpu_block for it in items]
                    seq.num_computed_tokens = len(hit) * bs
                    seq.num_registered_blocks = len(hit)
                    seq.status = SequenceStatus.LOADING
                    self.loading[seq.seq_id] = seq
                    self.tiers.start_load(seq.seq_id, items)
                    return 0
        cached = len(hit) * bs
        n = min(seq.num_tokens - cached, budget)
        need = self._blocks_for(cached + n) - len(hit)
        if need + hit_free > bm.num_free_blocks:
            return -1
        bm.touch(hit)
        seq.block_table = hit + bm.allocate(need)
        seq.num_computed_tokens = cached
        seq.num_registered_blocks = len(hit)
        self._count_hit(seq, len(hit))
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append((seq, n))
        return n

    def _admit_remote(self, seq: Sequence, hit: list[int], hit_free: int) -> int | None:
        """A decode leg: load the pulled blocks this engine lacks (after its own GPU hit) through
        staging slots, like a load-back; 0 (LOADING), -1 (not yet: too few free blocks, or too
        few staging slots while loads in flight will give theirs back), or None to go on as a
        local prefill (it holds them all already). More blocks than the engine has staging
        slots: as many as there are now, the rest chunk by chunk as each load ends and gives
        its slots back (:meth:`on_loaded`), so the pinned host memory of staging stays bounded
        whatever the prompt (``--staging-blocks``) and nothing pulled is computed again."""
        bm, remote = self.bm, seq.remote_kv
        assert remote is not None
        start, end = len(hit), remote.first + len(remote.blocks)
        if not remote.first <= start < end:
            # it holds the whole pulled prefix already, or lost some of what it held when it
            # pulled (evicted meanwhile): the gap is computed here, and so is the rest
            seq.remote_kv = None
            return None
        if end - start + hit_free > bm.num_free_blocks:
            return -1
        host = self.tiers.host
        want = min(end - start, host.staging) if host is not None else 0
        if host is not None and host.num_free_staging < want and self.loading:
            return -1
        seq.remote_kv = RemoteKV(remote.blocks[start - remote.first :], start)
        bm.touch(hit)
        seq.block_table = hit
        if not self._load_pulled(seq):  # no staging slot free: it is computed here, from its hit
            bm.free_blocks(hit)
            seq.block_table = []
            return None
        self._count_hit(seq, len(hit))  # the pulled blocks are no prefix-cache hit of this engine
        # usage.cached_tokens: the prefill engine's own hit, as vLLM >= 0.32 reports it
        seq.num_cached_tokens = max(seq.num_cached_tokens, remote.cached_tokens)
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_registered_blocks = len(hit)
        return 0

    def _load_pulled(self, seq: Sequence) -> bool:
        """Stage the next chunk of a decode leg's pulled blocks (``seq.remote_kv``, starting at
        the end of its block table) into the free staging slots and start loading it; False
        when no slot or GPU block is free for even one (its prefix so far stays, the rest is
        computed here)."""
        remote = seq.remote_kv
        assert remote is not None and remote.first == len(seq.block_table)
        n = min(len(remote.blocks), self.bm.num_free_blocks)
        metas = [self._meta(seq, i) for i in range(remote.first, remote.first + n)]
        items = stage_blocks(self.tiers, metas, remote.blocks[:n])
        if not items:
            seq.remote_kv = None
            return False
        k = len(items)
        seq.remote_kv = (
            RemoteKV(remote.blocks[k:], remote.first + k) if k < len(remote.blocks) else None
        )
        for it, bid in zip(items, self.bm.allocate(k)):
            it.gpu_block = bid
        seq.block_table = seq.block_table + [it.gpu_block for it in items]
        seq.status = SequenceStatus.LOADING
        self.loading[seq.seq_id] = seq
        self.tiers.start_load(seq.seq_id, items)
        return True

    def _meta(self, seq: Sequence, i: int) -> BlockMeta:
        h = seq.block_hashes[i]
        parent = seq.block_hashes[i - 1] if i else None
        return BlockMeta(h, parent, tuple(seq.block_tokens(i, self.block_size)))

    def _count_hit(self, seq: Sequence, blocks: int) -> None:
        self.bm.queries += seq.num_tokens
        self.bm.hits += blocks * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = blocks * self.block_size

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.bm.free_blocks(seq.block_table)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    # ------------------------------------------------------------------ transitions

    def on_loaded(self, job: LoadJob) -> Sequence | None:
        """A load-back finished: the sequence runs with its loaded prefix computed."""
        seq = self.loading.pop(job.seq_id, None)
        if seq is None:
            return None
        seq.add_engine_time(job.elapsed_s)
        if seq.status is SequenceStatus.FINISHED:  # aborted while loading
            self.bm.free_blocks(seq.block_table)
            seq.block_table, seq.remote_kv = [], None
            return None
        if seq.remote_kv is not None and self._load_pulled(seq):
            return None  # the next chunk of its pulled blocks is loading now
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks (a loading one: once its copy ends)."""
        status = seq.status
        seq.status = SequenceStatus.FINISHED
        if status is SequenceStatus.LOADING:
            return
        if status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq in self.running:
            self.running.remove(seq)
        self.bm.free_blocks(seq.block_table)
        seq.block_table = []
