"""Handles for copies in flight: a load-back job and the sim's modeled DISK/EXTERNAL read delay."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.runner.base import Transfer
from engine.tiers import BlockMeta

__all__ = ["Delayed", "LoadItem", "LoadJob"]


class Delayed(Transfer):
    """A runner copy preceded by modeled DISK/EXTERNAL read time (sim only; 0 for real runners)."""

    def __init__(self, inner: Transfer, extra_s: float, speedup: float) -> None:
        self.inner = inner
        self.extra_s = extra_s
        self._speedup = speedup
        self._start = time.monotonic()

    @property
    def elapsed_s(self) -> float:  # type: ignore[override]
        return self.extra_s + self.inner.elapsed_s

    def done(self) -> bool:
        due = self._start + self.elapsed_s / self._speedup
        return self.inner.done() and time.monotonic() >= due

    def wait(self) -> None:
        self.inner.wait()
        delay = self._start + self.elapsed_s / self._speedup - time.monotonic()
        if delay > 0:
            time.sleep(delay)


@dataclass
class LoadItem:
    meta: BlockMeta
    tier: str
    slot: int  # host slot read by the swap-in (tier slot or staging slot)
    gpu_block: int = -1


@dataclass
class LoadJob:
    seq_id: int
    items: list[LoadItem]
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def elapsed_s(self) -> float:
        return max((t.elapsed_s for t in self.transfers), default=0.0)
