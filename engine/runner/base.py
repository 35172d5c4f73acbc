"""The model runner interface: what the scheduler and the tiers ask of a runner.

Two runners implement it: ``sim`` (``engine.runner.sim``: no tensors, a timing model) and ``torch``
(``engine.torch_runner``: a real decoder). The engine core owns *which* block holds *what*
(block manager, tiers); the runner owns the *bytes*:

* the GPU KV pool: ``num_gpu_blocks`` blocks of ``block_size`` tokens. The torch runner keeps one
  tensor per layer, ``[num_gpu_blocks, block_size, ...]``, indexed by the block manager's block ids.
* the host pool: ``num_host_slots`` slots of one block each (pinned memory on CUDA). The engine uses
  them for the CPU_PINNED tier and as staging for DISK/EXTERNAL transfers, by slot id.

Contract (the engine core relies on it; the runner must keep it):

1. ``execute`` runs one continuous-batching step. For each :class:`ScheduledSeq` it writes the KV of
   ``token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]`` into the GPU blocks of
   ``block_table`` (token at position ``p`` goes to block ``block_table[p // block_size]``, offset
   ``p % block_size``), attending to every earlier position (already in the pool: cached, loaded
   or computed by earlier steps). It returns one sampled token for each sequence whose
   ``sample`` flag is set (its prompt is complete after this step, or it is decoding).
2. ``swap_out``/``swap_in`` start copies between GPU blocks and host slots and return a
   :class:`Transfer` at once. The engine polls ``Transfer.done()`` (or calls ``wait()``) and only
   then publishes ``BlockStored(CPU_PINNED)`` (swap-out) or lets a step read the blocks (swap-in).
   While a transfer is pending, the engine neither writes its source nor reads its destination,
   and does not reuse either; ``execute`` need not order itself against pending transfers.
3. ``read_host``/``write_host`` export/import one host slot's KV as ``bytes`` (exactly
   ``kv_block_bytes`` long) for DISK files and the EXTERNAL store. They are synchronous and must
   only be called for slots with no pending transfer.
4. Calls come from one thread at a time (the engine's step thread); a runner need not be thread
   safe.

Sampling is stateless across steps: a seeded request draws its token for output position ``n``
from a generator seeded with ``(seed, n)``, so preemption by recompute and retries reproduce it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DoneTransfer",
    "ModelRunner",
    "RunnerConfig",
    "RunnerError",
    "SamplingParams",
    "ScheduledSeq",
    "StepOutput",
    "Transfer",
]


class RunnerError(RuntimeError):
    """A runner could not be built or failed a step/transfer (bad options, missing model, OOM)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy (top_p and seed are then unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class RunnerConfig:
    """What every runner is built from.

    ``options`` holds runner-specific settings from the CLI (``--model``, ``--device``, ``--dtype``
    for torch; timing-model overrides for sim), already parsed into Python values, keyed by the
    option name without dashes, with ``-`` replaced by ``_`` (``--model-path`` → ``model_path``).
    A runner rejects options it does not know with :class:`RunnerError`.
    """

    block_size: int
    num_gpu_blocks: int
    num_host_slots: int
    #: ``--model``: for torch a local HF directory or ``tiny-random[:layers=2,d=256,...]``;
    #: for sim only a label.
    model: str = "sim"
    speedup: float = 1.0
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    seq_id: int
    #: All tokens of the sequence so far: prompt followed by generated tokens.
    token_ids: Sequence[int]
    #: Positions ``[0, num_computed_tokens)`` already hold KV in the GPU pool (prefix cache hit,
    #: loaded back from a lower tier, or computed by earlier steps).
    num_computed_tokens: int
    #: Positions computed this step (a prompt chunk under chunked prefill, or 1 when decoding).
    num_new_tokens: int
    #: GPU block ids covering positions ``[0, num_computed_tokens + num_new_tokens)``.
    block_table: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: Sample a next token after this step (prompt complete, or decoding).
    sample: bool = True
    #: Number of tokens generated so far (the output position of the token sampled now).
    num_output_tokens: int = 0


@dataclass
class StepOutput:
    """Result of one ``execute``."""

    #: seq_id → sampled token, for each sequence scheduled with ``sample=True``.
    tokens: dict[int, int]
    #: Modeled (sim) or measured (torch) compute time of the step in seconds, before --speedup.
    #: The engine accumulates it as the sequence's engine time (TTFT, latency metrics).
    elapsed_s: float = 0.0


class Transfer(abc.ABC):
    """A pending copy between the GPU pool and the host pool."""

    #: Modeled (sim) or measured (torch) duration, known once done.
    elapsed_s: float = 0.0

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the bytes have arrived (non-blocking; e.g. a CUDA event query)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until ``done()``."""


class DoneTransfer(Transfer):
    """A transfer that completed synchronously (CPU device, empty request)."""

    def __init__(self, elapsed_s: float = 0.0) -> None:
        self.elapsed_s = elapsed_s

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class ModelRunner(abc.ABC):
    """A model over a paged KV pool. Subclasses set the attributes below in ``__init__``."""

    #: Short name used by ``--runner`` (``sim``, ``torch``).
    name: str = ""
    block_size: int
    num_gpu_blocks: int
    num_host_slots: int
    #: Token ids the model may emit; samplers draw from ``[0, vocab_size)``.
    vocab_size: int = 256
    #: Tokens that end a generation (empty: only max_tokens/stop strings end it).
    eos_token_ids: tuple[int, ...] = ()
    #: A local ``tokenizer.json`` the model came with, or None (the engine then uses bytes).
    tokenizer_path: str | None = None

    @property
    @abc.abstractmethod
    def kv_block_bytes(self) -> int:
        """Size of one block's KV over all layers, as exported by ``read_host``."""

    @property
    def kv_fingerprint(self) -> str:
        """Identifies the KV layout and weights, so a shared EXTERNAL store never hands one model's
        bytes to another. Engines with equal fingerprints may exchange blocks."""
        return f"{self.name}:{self.block_size}:{self.kv_block_bytes}"

    @abc.abstractmethod
    def execute(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        """Run one step over ``seqs`` (see the module contract, point 1). Blocks until done."""

    @abc.abstractmethod
    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        """Start copying GPU blocks to host slots: ``pairs`` is ``[(gpu_block, host_slot), ...]``."""

    @abc.abstractmethod
    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        """Start copying host slots to GPU blocks: ``pairs`` is ``[(host_slot, gpu_block), ...]``."""

    @abc.abstractmethod
    def read_host(self, slot: int) -> bytes:
        """Export one host slot's KV (for a DISK file or the EXTERNAL store)."""

    @abc.abstractmethod
    def write_host(self, slot: int, data: bytes) -> None:
        """Import bytes produced by ``read_host`` (of a runner with the same fingerprint) into a slot.

        Raises :class:`RunnerError` when ``len(data) != kv_block_bytes``."""

    def io_delay(self, tier: str, num_bytes: int, *, write: bool = False) -> float:
        """Modeled seconds (before ``--speedup``, like ``StepOutput.elapsed_s``) a DISK/EXTERNAL
        read (or write) of ``num_bytes`` should take *in addition* to the real I/O the engine
        does. The sim runner models ``bytes / bandwidth + latency`` for reads here (its blocks
        are tiny fake payloads); a real runner returns 0 because real I/O takes real time."""
        return 0.0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device memory and threads."""
