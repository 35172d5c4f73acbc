"""The engine's outgoing KV event log: what the block manager and the tiers report, in order.

Producers append normalized :mod:`indexer.events` structs as state changes *have happened* (a block
computed, a copy completed, a block evicted); the engine drains the log after each step and hands
it to the publisher as one batch. Tier/medium strings are the canonical tier names,
:data:`indexer.events.CANONICAL_TIERS` (the one list; the engine keeps no copy), checked here.
"""

from __future__ import annotations

from collections.abc import Sequence

from indexer.events import CANONICAL_TIERS, AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["EventLog"]


def _check_tier(tier: str) -> None:
    if tier not in CANONICAL_TIERS:
        raise ValueError(f"unknown tier {tier!r}: the engine publishes only {CANONICAL_TIERS}")


class EventLog:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[Event] = []
        self.counts: dict[str, int] = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def stored(
        self, tier: str, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int]
    ) -> None:
        """``hashes`` are consecutive blocks of one chain; ``token_ids`` covers all of them."""
        if not hashes:
            return
        _check_tier(tier)
        if len(token_ids) != len(hashes) * self.block_size:
            raise ValueError("BlockStored needs block_size token ids per block")
        self._events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=list(token_ids),
                block_size=self.block_size,
                tier=tier,
                medium=tier,
            )
        )
        self.counts["BlockStored"] += 1

    def removed(self, tier: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        _check_tier(tier)
        self._events.append(BlockRemoved(block_hashes=list(hashes), tier=tier, medium=tier))
        self.counts["BlockRemoved"] += 1

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())
        self.counts["AllBlocksCleared"] += 1

    def drain(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def __len__(self) -> int:
        return len(self._events)
