"""``TorchRunner``: the engine's ``torch`` runner — a real decoder over the paged KV pool.

Implements :class:`engine.runner.base.ModelRunner`: ``execute`` computes only each sequence's new
tokens (a cached or loaded prefix is attended to, never recomputed) and samples where asked;
``swap_out``/``swap_in`` move real bytes between the device pool and the host pool;
``read_host``/``write_host`` turn host slots into bytes for DISK files and the EXTERNAL store.
Options (``RunnerConfig.options``): ``device`` (auto|cuda|cpu), ``dtype``
(auto|bfloat16|float16|float32). ``RunnerConfig.model`` is a local HF directory or a preset spec
such as ``tiny-random:layers=2,d=256,heads=4,kv_heads=2`` (the default).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.runner.base import (
    ModelRunner,
    RunnerConfig,
    RunnerError,
    ScheduledSeq,
    StepOutput,
    Transfer,
)

from .attention import SeqSpan, build_metadata
from .kv_pool import KVPool
from .loader import LoaderError, load_model
from .sampler import Sampler, SamplingSpec

__all__ = ["DEFAULT_MODEL", "TorchRunner"]

DEFAULT_MODEL = "tiny-random"
_OPTIONS = ("device", "dtype")


class TorchRunner(ModelRunner):
    name = "torch"

    def __init__(self, config: RunnerConfig) -> None:
        unknown = sorted(set(config.options) - set(_OPTIONS))
        if unknown:
            raise RunnerError(
                f"unknown torch runner option(s) {unknown}; known: {', '.join(_OPTIONS)}"
            )
        if config.block_size <= 0 or config.num_gpu_blocks <= 0 or config.num_host_slots < 0:
            raise RunnerError("block_size and num_gpu_blocks must be positive")
        spec = config.model if config.model not in ("", "sim") else DEFAULT_MODEL
        device = config.options.get("device") or "auto"
        dtype = config.options.get("dtype") or "auto"
        try:
            loaded = load_model(spec, device=str(device), dtype=str(dtype))
            self.pool = KVPool(
                loaded.config,
                num_blocks=config.num_gpu_blocks,
                block_size=config.block_size,
                num_host_slots=config.num_host_slots,
                device=loaded.device,
                dtype=loaded.dtype,
            )
        except (LoaderError, torch.OutOfMemoryError) as exc:
            raise RunnerError(f"cannot build the torch runner for {spec!r}: {exc}") from exc
        self.model = loaded.model
        self.model_config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.num_gpu_blocks = config.num_gpu_blocks
        self.num_host_slots = config.num_host_slots
        self.vocab_size = loaded.config.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.tokenizer_path = str(loaded.tokenizer_path) if loaded.tokenizer_path else None
        self._weights_id = loaded.weights_id
        self._sampler = Sampler(config.seed)

    @property
    def kv_block_bytes(self) -> int:
        return self.pool.block_bytes

    @property
    def kv_fingerprint(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"torch:{self._weights_id}:{dtype}:{self.block_size}:{self.kv_block_bytes}"

    def _check(self, seq: ScheduledSeq) -> None:
        end = seq.num_computed_tokens + seq.num_new_tokens
        if seq.num_new_tokens <= 0 or seq.num_computed_tokens < 0 or end > len(seq.token_ids):
            raise RunnerError(
                f"seq {seq.seq_id}: bad token range {seq.num_computed_tokens}+{seq.num_new_tokens}"
                f" of {len(seq.token_ids)}"
            )
        needed = -(-end // self.block_size)
        table = seq.block_table
        if len(table) < needed or any(not 0 <= b < self.num_gpu_blocks for b in table[:needed]):
            raise RunnerError(f"seq {seq.seq_id}: bad block table for {end} tokens")

    def forward_logits(self, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Run the step's forward pass (KV written to the pool) and return float32 logits
        ``[len(sampled), vocab]`` for the sequences with ``sample`` set, in order."""
        ids: list[int] = []
        spans: list[SeqSpan] = []
        for seq in seqs:
            self._check(seq)
            c, n = seq.num_computed_tokens, seq.num_new_tokens
            ids.extend(seq.token_ids[c : c + n])
            spans.append(SeqSpan(c, n, seq.block_table))
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RunnerError(f"token id outside the model's vocabulary [0, {self.vocab_size})")
        meta = build_metadata(spans, self.block_size, self.device)
        rows = [meta.q_starts[i] + meta.q_lens[i] - 1 for i, seq in enumerate(seqs) if seq.sample]
        rows_t = torch.tensor(rows, dtype=torch.long).to(self.device)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device)
        try:
            return self.model(input_ids, self.pool.layers, meta, rows_t)
        except torch.OutOfMemoryError as exc:
            raise RunnerError(f"out of memory in a step of {len(ids)} tokens: {exc}") from exc

    def execute(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        if not seqs:
            return StepOutput(tokens={})
        t0 = time.perf_counter()
        logits = self.forward_logits(seqs)
        sampled = [seq for seq in seqs if seq.sample]
        if sampled:
            specs = [self._spec(seq) for seq in sampled]
            positions = [seq.num_output_tokens for seq in sampled]
            tokens = self._sampler.sample(logits, specs, positions)  # syncs the device
        else:
            tokens = []
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # elapsed_s must cover the KV writes
        return StepOutput(
            tokens={seq.seq_id: tok for seq, tok in zip(sampled, tokens)},
            elapsed_s=time.perf_counter() - t0,
        )

    @staticmethod
    def _spec(seq: ScheduledSeq) -> SamplingSpec:
        p = seq.sampling
        return SamplingSpec(temperature=p.temperature, top_p=p.top_p, seed=p.seed)

    def _check_pairs(self, pairs: Sequence[tuple[int, int]], gpu_first: bool) -> None:
        for a, b in pairs:
            block, slot = (a, b) if gpu_first else (b, a)
            if not (0 <= block < self.num_gpu_blocks and 0 <= slot < self.num_host_slots):
                raise RunnerError(f"bad transfer pair {(a, b)}")

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        self._check_pairs(pairs, gpu_first=True)
        return self.pool.copy_out(pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        self._check_pairs(pairs, gpu_first=False)
        return self.pool.copy_in(pairs)

    def read_host(self, slot: int) -> bytes:
        if not 0 <= slot < self.num_host_slots:
            raise RunnerError(f"bad host slot {slot}")
        return self.pool.export_slot(slot)

    def write_host(self, slot: int, data: bytes) -> None:
        if not 0 <= slot < self.num_host_slots:
            raise RunnerError(f"bad host slot {slot}")
        if len(data) != self.kv_block_bytes:
            raise RunnerError(f"block bytes: got {len(data)}, expected {self.kv_block_bytes}")
        self.pool.import_slot(slot, data)

    def close(self) -> None:
        if self.device.type == "cuda":
            self.pool.synchronize()
            torch.cuda.empty_cache()
