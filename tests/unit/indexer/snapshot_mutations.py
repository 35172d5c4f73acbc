"""A valid snapshot with every kind of rank (plain, several tiers, duplicate stores, a re-chunked
one) and mutations of it at the msgpack level: what the snapshot fuzzers feed the decoder
(tests/unit/indexer/test_snapshot_fuzz.py) and a warm start over HTTP
(tests/integration/router/replicas/test_replicas_warm_budget.py)."""

from __future__ import annotations

from typing import Any

import msgspec

from indexer.events import BlockRemoved, BlockStored, EventBatch
from indexer.index import PrefixIndex

__all__ = ["BASE", "OBJ", "PATHS", "mutated", "paths", "valid_snapshot"]


def valid_snapshot() -> bytes:
    """A small index with every kind of state a rank can have, as its snapshot."""
    ix = PrefixIndex(16)
    ix.add_worker("w", 0, model="m")
    ix.add_worker("w", 1, model="m")
    ix.add_worker("paged", 0, model="m")
    toks = list(range(64))
    ix.apply_batch("w", EventBatch(0, 1.0, [BlockStored([1, 2, 3, 4], None, toks, 16)]), dp_rank=0)
    again = EventBatch(1, 2.0, [BlockStored([4], 3, toks[48:], 16)])  # a duplicate store of 4
    ix.apply_batch("w", again, dp_rank=0)
    cpu = BlockStored([1, 2], None, toks[:32], 16, tier="CPU_PINNED", medium="CPU")
    ix.apply_batch("w", EventBatch(2, 3.0, [cpu]), dp_rank=1)
    ix.apply_batch("paged", EventBatch(3, 4.0, [BlockStored([7, 8, 9], None, toks[:24], 8)]))
    ix.apply_batch("paged", EventBatch(4, 5.0, [BlockRemoved([9])]))
    seqs = {("w", 0): 5, ("w", 1): 2, ("paged", 0): 9}
    return ix.snapshot_bytes(seqs)


BASE = valid_snapshot()
OBJ = msgspec.msgpack.decode(BASE)


def paths(obj: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*at, i))
    return out


PATHS = paths(OBJ)[1:]


def mutated(path: tuple, how: str, value: Any) -> bytes:
    obj = msgspec.msgpack.decode(BASE)  # (a fresh copy)
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    old = parent[path[-1]]
    if how == "replace":
        parent[path[-1]] = value
    elif how == "repeat" and isinstance(old, list):
        parent[path[-1]] = old + old
    elif how == "huge" and isinstance(old, list) and old:
        parent[path[-1]] = old * 5000
    elif how == "drop" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return msgspec.msgpack.encode(obj)
