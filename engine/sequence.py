"""One request's state inside the engine core: tokens, KV progress, block table, timings."""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.runner.base import SamplingParams

__all__ = ["FinishReason", "RemoteKV", "Request", "Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, no GPU blocks (new, or preempted)
    LOADING = "loading"  # holds GPU blocks, waiting for a load-back from a lower tier
    RUNNING = "running"  # holds GPU blocks, scheduled every step until finished
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token (or a stop string, decided by the server)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # client went away or the server aborted it


@dataclass
class RemoteKV:
    """KV a decode engine pulled from a prefill engine (``engine.pd``): the bytes of the prompt's
    full blocks ``[first, first + len(blocks))`` (it held the first ones already when it pulled),
    and the prefill engine's own prefix hit."""

    blocks: list[bytes]
    first: int = 0
    cached_tokens: int = 0


@dataclass
class Request:
    """What the server submits: already tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    #: a prefill leg (``do_remote_decode``): lease the prompt's blocks when it finishes
    kv_hold: bool = False
    #: a decode leg (``do_remote_prefill``): the pulled prefix, loaded instead of computed
    remote_kv: RemoteKV | None = None


class Sequence:
    """A request being served. Owned by the engine core thread; the server never touches it."""

    def __init__(self, req: Request, *, seq_id: int, arrival: float) -> None:
        self.seq_id = seq_id
        self.request_id = req.request_id
        self.token_ids: list[int] = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.max_tokens = req.max_tokens
        self.sampling = req.sampling
        self.ignore_eos = req.ignore_eos
        self.kv_hold = req.kv_hold
        #: dropped once staged (the bytes are held only until admission)
        self.remote_kv = req.remote_kv
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        #: Positions whose KV is in the GPU blocks of ``block_table``.
        self.num_computed_tokens = 0
        #: Prompt tokens served from the cache (GPU hit + load-back) when first scheduled.
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        #: Chained engine hashes of the full blocks of ``token_ids`` (extended lazily).
        self.block_hashes: list[int] = []
        #: Blocks of ``block_table`` already registered in the prefix cache (a prefix of it).
        self.num_registered_blocks = 0
        self.num_preemptions = 0
        self.arrival = arrival
        self.first_token_at: float | None = None
        #: Modeled/measured compute (steps it took part in + its load-backs) until its first token:
        #: the engine-time TTFT, free of queueing noise.
        self.engine_ttft_s = 0.0
        self._engine_s = 0.0

    # ------------------------------------------------------------------ tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)

    def block_tokens(self, i: int, block_size: int) -> Seq[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]

    # ------------------------------------------------------------------ timing

    def add_engine_time(self, seconds: float) -> None:
        self._engine_s += seconds

    def mark_first_token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            self.engine_ttft_s = self._engine_s

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the KV progress, keep the tokens generated so far."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_registered_blocks = 0
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
