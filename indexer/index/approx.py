"""The approximate tree of a worker rank that publishes no KV events (docs/architecture.md §3).

Such a rank's entries are the router blocks of the requests the router sent there, as if the
worker stored each request's prompt on GPU: the same tables and presence masks as an event-fed
rank, so ``match`` and the scorer read both kinds alike, on one scale. An entry's engine hash is
its router hash (there is no engine hash to know), so a block sent twice is one entry.

Bounded like a KV cache, least recently used first: every send renews the request's blocks, and
past the rank's cap (its GPU capacity, or the default per rank: ``indexer.index.evict``) the
least recently sent go, exactly at the cap (no margin: the tree guesses what the cache holds,
and the cache holds no more). A request's blocks are renewed last block first, so its first
block is its most recent: a prefix is forgotten from its tail, as vLLM's free queue evicts a
freed request's tail blocks first, and a forgotten block never leaves its descendants
matchable for nothing (a match ends at the first missing block).

Writers only: called on the index's writer (the subscriber task in the router, the replay's
loop in virtual time).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from indexer.index.native import remove_gpu
from indexer.index.state import IndexState
from indexer.index.types import GPU, RankRecord

__all__ = ["held", "record", "trim"]


def held(state: IndexState, w: RankRecord) -> list[int]:
    """The router blocks event-fed rank ``w`` holds (any tier, re-chunked pages included), the
    most recently stored first: the seed of its tree when the closed loop turns it approximate
    for stores it lost (``PrefixIndex.set_approximate(keep=True)``). What its events did say was
    true, and an empty tree would forget it; a store order is the best recency the index knows
    (a table keeps insertion order), and past the cap the oldest go first."""
    present, bit = state.present, w.bit
    hashes = list(w.table.values())
    if w.rechunk is not None:
        hashes.extend(w.rechunk.cover)
    # (a router block several engine blocks map to comes once; one the rank lost is not held)
    return [h for h in dict.fromkeys(reversed(hashes)) if present.get(h, 0) & bit]


def record(state: IndexState, w: RankRecord, hashes: Sequence[int]) -> int:
    """The router sent a request of router blocks ``hashes`` to rank ``w``: its blocks enter
    (or renew) the rank's tree, its first block most recent. Returns the blocks new to it."""
    table, present, bit = w.table, state.present, w.bit
    added = 0
    for h in reversed(hashes):
        if h in table:
            del table[h]  # re-inserted: most recently used
            table[h] = h
            continue
        table[h] = h
        # a GPU-only block of this rank alone: ``IndexState.set_mask(w, h, 0, GPU bit)``
        present[h] = present.get(h, 0) | bit
        added += 1
    w.tier_counts[GPU] += added
    w.counted += added
    state.counted_total += added
    return added


def trim(state: IndexState, w: RankRecord, cap: int) -> int:
    """Forget rank ``w``'s least recently sent blocks down to ``cap`` (0: no cap); the
    entries forgotten (counted in the rank's ``forgotten_entries``)."""
    excess = len(w.table) - cap
    if cap <= 0 or excess <= 0:
        return 0
    victims = list(islice(w.table, excess))
    # every entry is a GPU-only block of its own (no tiers, duplicates or collisions): the C
    # loop of removals takes them all; the general path is for a rank that once had events
    done = remove_gpu(w.table, w.emask, state.present, ~w.bit, victims, 0)
    w.tier_counts[GPU] -= done
    for e in victims[done:]:
        mask, t = w.emask.get(e, 1), 0
        while mask:
            if mask & 1:
                state.remove_tier(w, e, t)
            mask >>= 1
            t += 1
    gone = len(victims)
    w.stats.forgotten_entries += gone
    w.counted -= gone
    state.counted_total -= gone
    return gone
