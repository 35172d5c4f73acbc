"""Snapshot/restore of the prefix index with each worker rank's last applied sequence number.

The file is msgpack: a header (format, hash function version, block size, tier names) and, per
worker rank, its engine table. Global tables are derived state and are rebuilt on load, so a
restored index answers every query like the original. A file written with another router hash
function or block size is refused: its router hashes would not match new requests. This module
owns the format and the writing; :mod:`indexer.index.snapshot_load` reads it back, validated and
under a budget.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Annotated

import msgspec

from indexer.hashing import HASH_VERSION
from indexer.index.state import IndexState
from indexer.index.types import WorkerKey

__all__ = [
    "FORMAT",
    "SnapshotBuilder",
    "encode_snapshot",
    "save_snapshot",
    "write_snapshot",
]

FORMAT = "kvrouter-index-snapshot/1"
_EH = int | bytes
#: a router hash (indexer.hashing: 64 bits, unsigned; msgpack holds no wider int): a peer's
#: snapshot may hold anything, and the C presence table takes only these (a negative one
#: raised OverflowError past the decoder)
_RH = Annotated[int, msgspec.Meta(ge=0)]


class _RBlock(msgspec.Struct, array_like=True):
    engine_hash: _EH
    parent: _EH | None
    tiers: int
    end: int
    state: int
    tail: list[int]


class _WorkerSnap(msgspec.Struct):
    worker_id: str
    dp_rank: int
    model: str
    seq: int | None
    engine_hashes: list[_EH]
    router_hashes: list[_RH]
    tiers: list[int]
    rechunk: list[_RBlock] = []
    cover: list[tuple[_RH, list[_EH]]] = []
    #: ``ts`` of the batch ``seq`` names (a new publisher process is told by another ts).
    ts: float | None = None
    #: (engine hash, tier, stores beyond the first)
    dups: list[tuple[_EH, int, int]] = []
    page: int = 0
    partial_groups: list[int] = []


_encoder = msgspec.msgpack.Encoder()


def write_snapshot(
    index: IndexState, path: str | os.PathLike[str], seqs: Mapping[WorkerKey, int]
) -> None:
    """Write ``index`` and each worker rank's resume point; atomic (write + rename)."""
    save_snapshot(path, encode_snapshot(index, seqs))


def save_snapshot(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``encode_snapshot``'s bytes to ``path``; atomic (write + rename). It reads no index,
    so it may run off the event loop (one writer at a time: they share the temporary file)."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def encode_snapshot(index: IndexState, seqs: Mapping[WorkerKey, int]) -> bytes:
    """``index`` and each worker rank's resume point, as the snapshot file holds them (a peer
    router's warm start fetches the same bytes over HTTP)."""
    builder = SnapshotBuilder(index)
    for key in builder.ranks():
        builder.add(key, seqs.get(key))
    return builder.finish()()


class SnapshotBuilder:
    """One snapshot taken a rank at a time, so that a caller on the event loop can yield between
    ranks instead of stalling for the whole index (87 ms at 1 M entries, ``bench_snapshot.py``).

    ``add`` copies one rank's tables with the resume point the caller read in the same step:
    each rank's part is consistent with its own seq, which is all a restore needs (a rank
    resumes from its own seq; the global tables are rebuilt on load). A rank removed meanwhile
    is left out, one added meanwhile waits for the next snapshot. ``finish`` reads the tier
    names (they only grow, so every part's tier bits have a name) and returns the encoding,
    which reads nothing of the index and may run in a thread."""

    def __init__(self, index: IndexState) -> None:
        self._index = index
        self._parts: list[_WorkerSnap] = []

    def ranks(self) -> list[WorkerKey]:
        return [key for key, _ in self._index.items()]

    def add(self, key: WorkerKey, point: int | None) -> None:
        w = self._index.by_key.get(key)
        if w is None:
            return
        emask = w.emask
        # (every block on the GPU tier alone, the usual case: no lookup per entry)
        tiers = [emask.get(e, 1) for e in w.table] if emask else [1] * len(w.table)
        ws = _WorkerSnap(
            worker_id=key[0],
            dp_rank=key[1],
            model=w.model,
            seq=None if point is None else int(point),
            ts=getattr(point, "ts", None),
            engine_hashes=list(w.table),
            router_hashes=list(w.table.values()),
            tiers=tiers,
            dups=[(e, t, n) for e, d in w.dups.items() for t, n in d.items()],
            page=w.page,
            partial_groups=sorted(w.partial_groups),
        )
        rc = w.rechunk
        if rc is not None:
            ws.rechunk = [
                _RBlock(e, b.parent, b.tiers, b.end, b.state, list(b.tail))
                for e, b in rc.blocks.items()
            ]
            ws.cover = [(h, list(c)) for h, c in rc.cover.items()]
        self._parts.append(ws)

    def finish(self) -> Callable[[], bytes]:
        head = (FORMAT, HASH_VERSION, self._index.block_size, list(self._index.tier_names))
        return partial(_encode_parts, head, self._parts)


class _SnapshotOut(msgspec.Struct):  # the file: a header, then each rank encoded on its own
    format: str
    hash_version: int
    block_size: int
    tiers: list[str]
    workers: list[msgspec.Raw]


def _encode_parts(head: tuple[str, int, int, list[str]], parts: list[_WorkerSnap]) -> bytes:
    # one encode call per rank: a thread running this gives the loop the GIL back between
    # ranks, not only after the whole file (the same bytes as encoding every rank in one call)
    workers = [msgspec.Raw(_encoder.encode(p)) for p in parts]
    return _encoder.encode(_SnapshotOut(*head, workers))
