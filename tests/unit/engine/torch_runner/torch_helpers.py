"""Helpers for the torch runner tests: a tiny float32 CPU model and a step driver that plays
the engine's part (block tables, prefill, decode) against the runner interface."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.runner.base import RunnerConfig, SamplingParams, ScheduledSeq
from engine.torch_runner.runner import TorchRunner

#: small enough for fast CPU tests, GQA on (4 query heads over 2 KV heads)
TINY = "tiny-random:layers=2,d=64,heads=4,kv_heads=2,vocab=97,seed=5"
BLOCK = 4


def make_runner(
    model: str = TINY, *, gpu_blocks: int = 64, host_slots: int = 16, block_size: int = BLOCK
) -> TorchRunner:
    return TorchRunner(
        RunnerConfig(
            block_size=block_size,
            num_gpu_blocks=gpu_blocks,
            num_host_slots=host_slots,
            model=model,
            options={"device": "cpu", "dtype": "float32"},
        )
    )


def prompt(n: int, seed: int = 0, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(
    seq_id: int,
    tokens: Sequence[int],
    computed: int,
    new: int,
    table: Sequence[int],
    *,
    sample: bool = True,
    sampling: SamplingParams | None = None,
    outputs: int = 0,
) -> ScheduledSeq:
    return ScheduledSeq(
        seq_id=seq_id,
        token_ids=list(tokens),
        num_computed_tokens=computed,
        num_new_tokens=new,
        block_table=list(table),
        sampling=sampling or SamplingParams(),
        sample=sample,
        num_output_tokens=outputs,
    )


def generate(
    runner: TorchRunner,
    tokens: Sequence[int],
    table: Sequence[int],
    n: int,
    *,
    computed: int = 0,
    outputs: int = 0,
    sampling: SamplingParams | None = None,
) -> list[int]:
    """Prefill ``tokens[computed:]`` then decode until ``n`` tokens were generated in total
    (counting ``outputs`` already generated); returns the new tokens only."""
    seq = list(tokens)
    out: list[int] = []
    new = len(seq) - computed
    while outputs + len(out) < n:
        got = runner.execute(
            [step(1, seq, computed, new, table, sampling=sampling, outputs=outputs + len(out))]
        )
        tok = got.tokens[1]
        computed += new
        new = 1
        seq.append(tok)
        out.append(tok)
    return out
