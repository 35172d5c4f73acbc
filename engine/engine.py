"""``LLMEngine``: the synchronous engine core — requests in, one step at a time, outputs out.

It wires the runner, block manager, tiers and scheduler, and owns the event log. Not thread safe:
one thread drives it (``engine.async_engine`` in the server, the test itself in unit tests).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from engine.block_manager import BlockManager, hash_seed
from engine.config import EngineConfig
from engine.kv_events import EventLog
from engine.offload import TierManager
from engine.pd.kv_io import export_blocks
from engine.pd.leases import Lease, LeaseTable
from engine.pd.params import KvTransferError
from engine.runner import ModelRunner, RunnerConfig, ScheduledSeq, make_runner
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Request, Sequence, SequenceStatus
from engine.stores import open_external
from engine.tiers import DiskTier, ExternalTier, HostPool
from indexer.events import Event

__all__ = ["EngineStats", "InvalidRequestError", "LLMEngine", "RequestOutput"]


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (too long, empty, duplicate id): a 400."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    #: Engine-time TTFT: modeled (sim) or measured (torch) compute and loads until the first token.
    engine_ttft_s: float | None = None
    #: a finished prefill leg: the lease on its blocks (None: none granted, see engine.pd.leases)
    kv_lease: Lease | None = None


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    loading: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    blocks: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    tier_errors: int = 0
    offload_skipped: int = 0
    events: dict[str, int] = field(default_factory=dict)
    #: the prefill side's leases (engine.pd.leases): granted, held now (and their blocks), ended
    #: by how (pulled, expired, evicted, refused: never granted)
    leases_granted: int = 0
    leases_held: int = 0
    lease_blocks: int = 0
    leases_ended: dict[str, int] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        host_slots = config.num_cpu_blocks + config.num_staging_slots
        if runner is None:
            default_model = "sim" if config.runner == "sim" else ""
            runner = make_runner(
                config.runner,
                RunnerConfig(
                    block_size=config.block_size,
                    num_gpu_blocks=config.num_gpu_blocks,
                    num_host_slots=host_slots,
                    model=config.model or default_model,
                    speedup=config.speedup,
                    seed=config.seed,
                    options=dict(config.runner_options),
                ),
            )
        self.runner = runner
        self.events = EventLog(config.block_size)
        self.bm = BlockManager(
            config.num_gpu_blocks,
            config.block_size,
            self.events,
            seed=hash_seed(runner.kv_fingerprint),
            enable_caching=config.enable_prefix_caching,
        )
        store = open_external(config.external_url, config.external_dir)
        self.tiers = TierManager(
            runner,
            self.bm,
            self.events,
            host=HostPool(config.num_cpu_blocks, config.num_staging_slots),
            disk=(
                DiskTier(config.disk_dir, config.num_disk_blocks, runner.kv_fingerprint)
                if config.disk_dir
                else None
            ),
            external=(
                ExternalTier(store, runner.kv_fingerprint, config.num_external_blocks)
                if store is not None
                else None
            ),
            mode=config.offload,
            speedup=config.speedup,
        )
        self.scheduler = Scheduler(
            self.bm,
            self.tiers,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
        )
        # a prefill engine's blocks held for decode engines: at most half the GPU pool, so
        # leases whose decode engine never comes cannot starve this engine's own requests
        self.leases = LeaseTable(
            self._release_blocks, lease_s=config.kv_lease_s, max_blocks=config.num_gpu_blocks // 2
        )
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, req: Request) -> Sequence:
        n = len(req.prompt_token_ids)
        limit = self.config.model_len
        if req.request_id in self._seqs:
            raise InvalidRequestError(f"request id {req.request_id!r} is already running")
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if req.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1")
        if n + req.max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens (the KV cache holds "
                f"{self.config.num_gpu_blocks} blocks of {self.config.block_size}). However, you "
                f"requested {n + req.max_tokens} tokens ({n} in the prompt, {req.max_tokens} in "
                "the completion)."
            )
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary")
        seq = Sequence(req, seq_id=next(self._ids), arrival=time.monotonic())
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)
        self.prompt_tokens += n
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.ABORT
        self.scheduler.finish(seq)
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.tiers.busy

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Complete finished copies, schedule, run one batch, and report new tokens."""
        self._poll()
        self.leases.expire()
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if not sched.scheduled:
            return outputs
        batch = [
            ScheduledSeq(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids,
                num_computed_tokens=seq.num_computed_tokens,
                num_new_tokens=n,
                block_table=seq.block_table,
                sampling=seq.sampling,
                sample=seq.num_computed_tokens + n == seq.num_tokens,
                num_output_tokens=seq.num_output_tokens,
            )
            for seq, n in sched.scheduled
        ]
        result = self.runner.execute(batch)
        now = time.monotonic()
        for (seq, n), item in zip(sched.scheduled, batch):
            seq.num_computed_tokens += n
            seq.add_engine_time(result.elapsed_s)
            self.bm.register_computed(seq)
            if not item.sample or seq.is_finished:
                continue
            token = result.tokens[seq.seq_id]
            seq.append_token(token)
            seq.mark_first_token(now)
            self.generation_tokens += 1
            if token in self.runner.eos_token_ids and not seq.ignore_eos:
                seq.finish_reason = FinishReason.STOP
            elif seq.num_output_tokens >= seq.max_tokens:
                seq.finish_reason = FinishReason.LENGTH
            lease = None
            if seq.finish_reason is not None:
                lease = self._hold(seq) if seq.kv_hold else None
                self.scheduler.finish(seq)
                self._seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [token]))
            outputs[-1].kv_lease = lease
        self._poll()
        return outputs

    # ------------------------------------------------------------------ prefill/decode

    def _hold(self, seq: Sequence) -> Lease | None:
        """Lease a finished prefill's full prompt blocks that a decode engine may pull: all but
        the block of the last prompt token, which the decode engine computes for its logits."""
        k = (seq.num_prompt_tokens - 1) // self.config.block_size
        return self.leases.grant(
            seq.request_id,
            tuple(seq.block_table[:k]),
            tuple(self.bm.hash_blocks(seq)[:k]),
            num_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            hold=self._pin_blocks,
        )

    def _pin_blocks(self, block_ids: tuple[int, ...]) -> None:
        for bid in block_ids:
            self.bm.pin(bid)

    def _release_blocks(self, block_ids: tuple[int, ...]) -> None:
        self.bm.free_blocks(block_ids)

    def export_lease(
        self, transfer_id: str, block_ids: list[int], first: int = 0
    ) -> tuple[Lease, list[bytes]]:
        """A decode engine's pull: the KV bytes of the lease's blocks from ``first`` on, and
        its blocks released; the lease is gone whatever the outcome (a transfer is read once)."""
        lease = self.leases.take(transfer_id)
        try:
            if tuple(block_ids) != lease.block_ids:
                raise KvTransferError(
                    f"transfer {transfer_id!r}: asked for {len(block_ids)} blocks "
                    f"{block_ids[:4]}..., the lease holds {len(lease.block_ids)} other ones",
                    "block_mismatch",
                )
            if not 0 <= first <= len(block_ids):
                raise KvTransferError(
                    f"transfer {transfer_id!r}: no block {first} to start at", "block_mismatch"
                )
            return lease, export_blocks(self.tiers, lease.block_ids[first:])
        finally:
            self.leases.done(lease)

    def wait_transfers(self) -> None:
        """Block until every pending copy completed and its effects were applied."""
        self.tiers.poll(wait=True)
        self._poll()

    def _poll(self) -> None:
        self.tiers.poll()
        for job in self.tiers.take_loaded():
            self.scheduler.on_loaded(job)

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        done = seq.status is SequenceStatus.FINISHED
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            finished=done,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            engine_ttft_s=seq.engine_ttft_s if seq.first_token_at is not None else None,
        )

    def run_until_idle(self, *, max_steps: int = 1_000_000) -> list[RequestOutput]:
        """Step until no request and no copy is pending (tests, offline use)."""
        out: list[RequestOutput] = []
        for _ in range(max_steps):
            if not self.has_work:
                return out
            out.extend(self.step())
            if not self.scheduler.running and self.tiers.busy:
                time.sleep(0.0005)  # only copies in flight: let them finish
        raise RuntimeError("engine did not go idle")

    # ------------------------------------------------------------------ cache control

    def reset_prefix_cache(self) -> None:
        """Forget every cached block on every tier and publish ``AllBlocksCleared``."""
        self.tiers.clear()
        for job in self.tiers.take_loaded():
            self.scheduler.on_loaded(job)
        self.bm.reset()
        # Running sequences keep their KV privately; their later blocks are re-registered only
        # once a cached parent exists again (never an orphan in the index).
        for seq in self.scheduler.running:
            seq.num_registered_blocks = len(seq.block_table)
        self.events.cleared()

    def block_listing(self) -> dict[str, set[int]]:
        """Engine hashes held per tier: GPU prefix cache, CPU_PINNED slots, DISK files,
        EXTERNAL blocks this engine stored or claimed."""
        return self.tiers.listing()

    def drain_events(self) -> list[Event]:
        return self.events.drain()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            loading=len(self.scheduler.loading),
            kv_usage=self.bm.usage,
            prefix_queries=self.bm.queries,
            prefix_hits=self.bm.hits,
            blocks=self.tiers.block_counts(),
            preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            tier_errors=self.tiers.errors,
            offload_skipped=self.tiers.skipped,
            events=dict(self.events.counts),
            leases_granted=self.leases.granted,
            leases_held=len(self.leases),
            lease_blocks=self.leases.num_blocks,
            leases_ended=dict(self.leases.ended),
        )

    def close(self) -> None:
        self.tiers.poll(wait=True)
        if self.tiers.external is not None:
            self.tiers.external.store.close()
        self.runner.close()
