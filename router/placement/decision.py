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
        "max_tokens",
        "n",
        "order",
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
        max_tokens: int | None = None,
    ) -> None:
        self.n = n  # request blocks (full blocks of the prompt)
        self.tokens = tokens  # prompt length
        self.candidates = candidates
        self.hashes = hashes  # per candidate (one list per index namespace, shared)
        self.order = order
        self.states = states  # per candidate: its worker
        self.block_size = block_size
        #: the answer's bound, when the request gives one (router.placement.pd.stall_weight)
        self.max_tokens = max_tokens
