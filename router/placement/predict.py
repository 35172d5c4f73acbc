"""Predicted blocks against herding (docs/architecture.md §5): router-owned, event-loop-only.

Requests that share a new prefix arrive before any KV event about it. After a request is routed,
its router block hashes are recorded as *predicted* on the chosen worker rank for ``ttl_s``; the
index's ``match(..., overlay=...)`` counts them as present (reported as ``predicted_blocks``, scored
like GPU). Entries end by TTL only: once the worker's ``BlockStored`` events arrive the index holds
the block itself and reports it under its real tier, so an extra overlay bit changes nothing, and a
prediction that never came true (request failed, block evicted) lasts at most ``ttl_s``.

``mask`` maps router hash → bitmask of worker slots (``PrefixIndex.slot``), the overlay shape.
The router records only the blocks past the chosen worker's matched prefix (neither held nor
predicted there yet), so a repeated prompt adds nothing, a prediction keeps its first expiry,
and the overlay stays small. Each recording covers a
chain segment ``hashes[k:]``; a request can meet a prediction only if it contains that segment's
first block (hashes are chained), which ``might_meet`` checks without touching the index.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

__all__ = ["PredictedBlocks"]


class PredictedBlocks:
    def __init__(
        self,
        ttl_s: float,
        *,
        max_blocks: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        self.mask: dict[int, int] = {}
        # (hash, slot) -> expiry of the newest prediction; the deque holds every recording in
        # expiry order (the TTL is constant), so expiring is a pop from the left.
        self._expiry: dict[tuple[int, int], float] = {}
        self._log: deque[tuple[float, int, Sequence[int]]] = deque()
        self._starts: dict[int, int] = {}  # first hash of each live recording -> recordings
        self.expired_early = 0

    def __len__(self) -> int:
        return len(self._expiry)

    def overlay(self) -> Mapping[int, int] | None:
        """What to pass to ``PrefixIndex.match``: ``None`` when empty keeps the index's fast path."""
        return self.mask or None

    def might_meet(self, hashes: Sequence[int]) -> bool:
        """Whether any block of ``hashes`` may be predicted somewhere (no false negatives)."""
        starts = self._starts
        if not starts:
            return False
        return not starts.keys().isdisjoint(hashes)

    def record(self, hashes: Sequence[int], slot: int) -> None:
        if self.ttl_s <= 0 or not hashes or self.max_blocks <= 0:
            return
        now = self._clock()
        self.expire(now)
        exp = now + self.ttl_s
        bit = 1 << slot
        mask = self.mask
        expiry = self._expiry
        for h in hashes:
            mask[h] = mask.get(h, 0) | bit
            expiry[(h, slot)] = exp
        self._log.append((exp, slot, hashes))
        first = hashes[0]
        self._starts[first] = self._starts.get(first, 0) + 1
        while len(expiry) > self.max_blocks and self._log:
            # over the memory cap: end the oldest predictions now rather than grow without bound
            self._pop(force=True)
            self.expired_early += 1

    def expire(self, now: float | None = None) -> None:
        if not self._log:
            return
        if now is None:
            now = self._clock()
        log = self._log
        while log and log[0][0] <= now:
            self._pop(force=False)

    def _pop(self, *, force: bool) -> None:
        exp, slot, hashes = self._log.popleft()
        first = hashes[0]
        left = self._starts.get(first, 0) - 1
        if left > 0:
            self._starts[first] = left
        else:
            self._starts.pop(first, None)
        bit = 1 << slot
        expiry = self._expiry
        mask = self.mask
        for h in hashes:
            k = (h, slot)
            e = expiry.get(k)
            # a newer recording of the same block on the same slot keeps it alive
            if e is None or (e > exp and not force):
                continue
            del expiry[k]
            m = mask.get(h, 0) & ~bit
            if m:
                mask[h] = m
            else:
                mask.pop(h, None)

    def drop_slot(self, slot: int) -> None:
        """A worker rank left: its slot may be reused, so forget every prediction on it."""
        bit = 1 << slot
        for k in [k for k in self._expiry if k[1] == slot]:
            del self._expiry[k]
            m = self.mask.get(k[0], 0) & ~bit
            if m:
                self.mask[k[0]] = m
            else:
                self.mask.pop(k[0], None)
        self._log = deque(e for e in self._log if e[1] != slot)
        self._starts = {}
        for _, _, hashes in self._log:
            self._starts[hashes[0]] = self._starts.get(hashes[0], 0) + 1
