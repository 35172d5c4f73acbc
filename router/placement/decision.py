"""A placement's scored state, :class:`Decision`: every candidate rank with its matched blocks,
load and cost, and the healthy ones best first. Made by :meth:`router.placement.placer.Placer.
place`, read by the pick (:mod:`router.placement.pd`) and by ``POST /route``'s answer."""

from __future__ import annotations

from collections.abc import Sequence

from router.placement.ports import WorkerView
from router.placement.scoring import Candidate

__all__ = ["Decision"]


class Decision:
    """One placement: every candidate rank scored, ``order`` = healthy ones best first."""

    __slots__ = (
        "block_size",
        "candidates",
        "hashes",
        "n",
        "order",
        "stall_weight",
        "states",
        "tokens",
    )

    def __init__(
        self,
        n: int,
        candidates: list[Candidate],
        hashes: list[Sequence[int]],
        order: list[int],
        states: list[WorkerView],
        block_size: int,
        tokens: int,
    ) -> None:
        self.n = n  # request blocks (full blocks of the prompt)
        self.tokens = tokens  # prompt length
        self.candidates = candidates
        self.hashes = hashes  # per candidate (one list per index namespace, shared)
        self.order = order
        self.states = states  # per candidate: its worker
        self.block_size = block_size
        #: what a prefill where it runs costs this request (router.placement.pd.stall_weight)
        self.stall_weight = 1.0
