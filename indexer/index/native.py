"""The native layer of the index: each hot loop has a C implementation (``indexer._chash``) and
a Python twin with the same answers. This façade picks one per concern at import, logs the
choice, and reports it in ``BACKENDS`` (exported by the router as a metric label). A C function
declines an input it does not handle by returning None; the caller then takes the general path.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from itertools import groupby

from indexer.events import EngineHash
from indexer.hashing import HAVE_C_HASH, chain_hashes

__all__ = [
    "BACKENDS",
    "MaskMap",
    "new_present",
    "remove_gpu",
    "store_gpu",
    "walk_lengths",
    "walk_overlay",
]

_log = logging.getLogger(__name__)


def _py_store_gpu(
    table: dict[EngineHash, int],
    present: dict[int, int],
    wbit: int,
    hashes: list[EngineHash],
    start: int,
    tokens: Sequence[int],
    block_size: int,
    parent: int,
) -> int:
    """Python twin of ``indexer._chash.store_gpu``: GPU-store blocks from ``start`` until one
    is already known or collides with another engine block of this worker; return where it stopped."""
    n = min(len(hashes), start + len(tokens) // block_size)
    router = chain_hashes(tokens[: (n - start) * block_size], block_size, parent)
    i = start
    for e, h in zip(hashes[start:n], router):
        if e in table:
            break
        m = present.get(h, 0)
        if m & wbit:
            break
        table[e] = h
        present[h] = m | wbit
        i += 1
    return i


def _py_remove_gpu(
    table: dict[EngineHash, int],
    emask: dict[EngineHash, int],
    present: dict[int, int],
    keep: int,
    hashes: list[EngineHash],
    start: int,
) -> int:
    """Python twin of ``indexer._chash.remove_gpu``: drop GPU-only blocks from ``start`` until
    one needs the general path; return where it stopped."""
    i = start
    for e in hashes[start:]:
        h = table.get(e)
        if h is None or e in emask or h not in present:
            break
        m = present[h] & keep
        if m:
            present[h] = m
        else:
            del present[h]
        del table[e]
        i += 1
    return i


def _py_walk_lengths(
    present: dict[int, int], hashes: list[int], alive: int, nslots: int
) -> tuple[list[int], int]:
    """Python twin of ``indexer._chash.walk_lengths``."""
    lengths = [0] * nslots
    pos = 0
    for p, grp in groupby(map(present.get, hashes)):
        if not p:
            break
        dead = alive & ~p
        alive &= p
        for slot in range(nslots):
            if dead >> slot & 1:
                lengths[slot] = pos
        if not alive:
            break
        pos += len(list(grp))
    for slot in range(nslots):
        if alive >> slot & 1:
            lengths[slot] = pos
    return lengths, pos


try:
    from indexer._chash import MaskMap, walk_overlay
    from indexer._chash import remove_gpu as _c_remove_gpu
    from indexer._chash import store_gpu as _c_store_gpu
    from indexer._chash import walk_lengths as _c_walk_lengths
except ImportError:  # pragma: no cover - only where the extension could not be built
    MaskMap = None
    walk_overlay = None
    store_gpu = _py_store_gpu
    remove_gpu = _py_remove_gpu
    walk_lengths = _py_walk_lengths
else:
    store_gpu = _c_store_gpu
    remove_gpu = _c_remove_gpu
    walk_lengths = _c_walk_lengths

#: Concern -> "c" or "python": what this process runs.
BACKENDS: dict[str, str] = {
    "chain_hash": "c" if HAVE_C_HASH else "python",
    "store_remove": "python" if store_gpu is _py_store_gpu else "c",
    "walk": "python" if walk_lengths is _py_walk_lengths else "c",
    "presence_table": "python" if MaskMap is None else "c",
}
_log.info("index native layer: %s", ", ".join(f"{k}={v}" for k, v in sorted(BACKENDS.items())))


def new_present() -> dict[int, int]:
    """The router hash -> slot mask table: the C ``MaskMap`` (one cache line per lookup, no int
    object per key; dict-like, typed as the dict it stands for) where built, else a dict. The C
    hot paths need the former; the Python twins take either."""
    if MaskMap is None:
        return {}
    return MaskMap(random.getrandbits(64))
