"""The global prefix index: every worker's cached blocks, by router block hash and storage tier
(docs/architecture.md §3). A package of one state and two sides:

- ``types``: the vocabulary (``WorkerKey``, tier ids, ``WorkerMatch``/``MatchResult``, errors);
- ``state``: ``IndexState``, the only owner of worker tables, the tier registry and the masks;
- ``apply``: events -> state, one entry point ``apply_batch`` (the subscriber task only);
- ``match``: request -> per-worker matched prefix, one entry point ``match`` (read-only);
- ``evict``: the optional cap (least recently matched first), swept by the writer;
- ``native``: the C/Python façade of the hot loops.

Engines whose page size differs from the router block size go through ``indexer.rechunk``;
snapshots through ``indexer.snapshot``. Single writer: only the subscriber task calls the
mutating methods; nothing here awaits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from indexer.index.evict import Evictor
from indexer.index.match import Matcher
from indexer.index.snapshot import read_snapshot, write_snapshot
from indexer.index.types import (
    MAX_UNKNOWN_MEDIUMS,
    SGLANG_ROOT_PARENT,
    IndexError_,
    MatchResult,
    SnapshotError,
    WorkerIndexStats,
    WorkerKey,
    WorkerMatch,
)

__all__ = [
    "MAX_UNKNOWN_MEDIUMS",
    "SGLANG_ROOT_PARENT",
    "IndexError_",
    "MatchResult",
    "PrefixIndex",
    "SnapshotError",
    "WorkerIndexStats",
    "WorkerKey",
    "WorkerMatch",
]


class PrefixIndex(Evictor, Matcher):
    """Global prefix index over every worker rank. See the package docstring."""

    def snapshot(self, path: str | os.PathLike[str], seqs: Mapping[WorkerKey, int]) -> None:
        """Write the index and each worker's last applied seq; atomic (write + rename)."""
        write_snapshot(self, path, seqs)

    @classmethod
    def restore(cls, path: str | os.PathLike[str]) -> tuple[PrefixIndex, dict[WorkerKey, int]]:
        return read_snapshot(cls, path)
