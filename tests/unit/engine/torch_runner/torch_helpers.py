"""Helpers for the torch runner tests: the device and dtypes they run on, a tiny model, and a step
driver that plays the engine's part (block tables, prefill, decode) against the runner interface.

Device: ``KVROUTER_TEST_DEVICE`` (``cpu`` by default, ``cuda`` on a GPU machine). Tests that
compare with a tolerance run in every dtype of ``DTYPES`` (``KVROUTER_TEST_DTYPES``, comma
separated): float32 on CPU; float32 and bfloat16 (the runner's default there) on CUDA. Tests that
compare tokens exactly run in float32 only: in bfloat16 two correct paths may pick different
tokens where the top two logits are within rounding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from engine.runner.base import RunnerConfig, SamplingParams, ScheduledSeq
from engine.torch_runner.runner import TorchRunner

DEVICE = os.environ.get("KVROUTER_TEST_DEVICE", "cpu")
if torch.device(DEVICE).type == "cuda" and not torch.cuda.is_available():
    # a run that asked for the GPU must not pass on the CPU by skipping
    raise RuntimeError(f"KVROUTER_TEST_DEVICE={DEVICE} but torch sees no CUDA device")
ON_CUDA = torch.device(DEVICE).type == "cuda"

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES = [
    _NAMED[name.strip()]
    for name in os.environ.get(
        "KVROUTER_TEST_DTYPES", "float32,bfloat16" if ON_CUDA else "float32"
    ).split(",")
]
#: what ``dtype="auto"`` gives a tiny-random model on DEVICE (the loader's resolve_dtype)
AUTO_DTYPE = torch.float32
if ON_CUDA:
    AUTO_DTYPE = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

#: ``assert_close`` tolerances for logits of the paged path against the dense forward (or a full
#: prefill), same device and dtype. float32 differs by reduction order only (~1e-6 on logits of
#: O(1..40)); bfloat16 rounds every activation and the logits themselves (an ulp is 0.03 at 4 and
#: 0.25 at 40; measured on CPU: up to 0.03 at 4, 0.125 at 40; on an H200, whose SDPA kernels sum in
#: another order than the dense reference, 0.129 at 1), so there it catches a wrong block or mask
#: (errors of O(1)), not a subtle slip, which the float32 runs are for
PAGED_TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-4, "rtol": 0.0},
    torch.bfloat16: {"atol": 0.25, "rtol": 0.02},
    torch.float16: {"atol": 0.02, "rtol": 0.004},
}

#: small enough for fast CPU tests, GQA on (4 query heads over 2 KV heads)
TINY = "tiny-random:layers=2,d=64,heads=4,kv_heads=2,vocab=97,seed=5"
BLOCK = 4


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_runner(
    model: str = TINY,
    *,
    gpu_blocks: int = 64,
    host_slots: int = 16,
    block_size: int = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> TorchRunner:
    return TorchRunner(
        RunnerConfig(
            block_size=block_size,
            num_gpu_blocks=gpu_blocks,
            num_host_slots=host_slots,
            model=model,
            options={"device": DEVICE, "dtype": dtype_name(dtype)},
        )
    )


def assert_greedy_pick(token: int, logits: torch.Tensor, dtype: torch.dtype) -> None:
    """``token`` is the argmax of ``logits`` (float32), or within rounding of it (bfloat16)."""
    if dtype == torch.float32:
        assert token == int(logits.argmax())
    else:
        top = float(logits.max())
        tol = PAGED_TOL[dtype]
        assert float(logits[token]) >= top - tol["atol"] - tol["rtol"] * abs(top)


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
