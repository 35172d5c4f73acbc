"""Token sampling: greedy, or temperature / top-k / top-p, seeded per request.

A seeded request draws its uniform for output position ``n`` from a CPU generator seeded with
``mix(seed, n)``: the same request gives the same tokens whatever it is batched with, after a
preemption (recompute), and on CPU or CUDA. The draw is an inverse-CDF lookup over the sorted,
truncated distribution, batched over all sampled rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Sampler", "SamplingSpec", "mix_seed"]

_M64 = (1 << 64) - 1


def mix_seed(seed: int, n: int) -> int:
    """splitmix64 of (seed, n), folded to the 63 bits ``manual_seed`` accepts."""
    x = (seed * 0x9E3779B97F4A7C15 + n + 1) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # for requests without their own seed
        self._gen = torch.Generator().manual_seed(seed)

    def _uniform(self, spec: SamplingSpec, position: int) -> float:
        if spec.seed is None:
            return float(torch.rand((), generator=self._gen))
        gen = torch.Generator().manual_seed(mix_seed(spec.seed, position))
        return float(torch.rand((), generator=gen))

    @torch.no_grad()
    def sample(
        self, logits: torch.Tensor, specs: Sequence[SamplingSpec], positions: Sequence[int]
    ) -> list[int]:
        """One token per row of ``logits`` ``[B, vocab]``; ``positions[i]`` is the index of the
        output token being drawn for row i (seeds the draw)."""
        if logits.shape[0] != len(specs):
            raise ValueError("one sampling spec per logits row")
        out = [0] * len(specs)
        greedy = [i for i, s in enumerate(specs) if s.greedy]
        rand = [i for i, s in enumerate(specs) if not s.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            for i, tok in zip(greedy, logits.index_select(0, idx).argmax(-1).tolist()):
                out[i] = int(tok)
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            rows = logits.index_select(0, idx).float()
            temps = torch.tensor([specs[i].temperature for i in rand], device=logits.device)
            probs = torch.softmax(rows / temps[:, None], dim=-1)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(-1)
            top_p = torch.tensor([specs[i].top_p for i in rand], device=logits.device)
            keep = (cum - sorted_p) < top_p[:, None]  # always keeps the most likely token
            ks = [specs[i].top_k if specs[i].top_k > 0 else probs.shape[-1] for i in rand]
            rank = torch.arange(probs.shape[-1], device=logits.device)[None, :]
            keep &= rank < torch.tensor(ks, device=logits.device)[:, None]
            kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p)).cumsum(-1)
            u = torch.tensor(
                [self._uniform(specs[i], positions[i]) for i in rand], device=logits.device
            )
            target = (u * kept[:, -1])[:, None]
            pick = torch.searchsorted(kept, target, right=True).clamp_(max=probs.shape[-1] - 1)
            for i, tok in zip(rand, order.gather(1, pick).squeeze(1).tolist()):
                out[i] = int(tok)
        return out
