"""Lower KV tiers below the GPU pool: what each holds and where the bytes live.

* :class:`HostPool` — CPU_PINNED: the runner's host slots ``[0, capacity)`` hold tier blocks
  (LRU); slots ``[capacity, capacity + staging)`` are staging buffers for DISK/EXTERNAL copies.
* :class:`DiskTier` — DISK: one file per block in a directory, bounded, LRU. The directory is this
  engine's alone and is emptied at start (the event stream starts from seq 0 with an empty index).
* :class:`ExternalTier` — EXTERNAL: a store shared by several engines, on a Redis server or a
  shared directory. Keys depend only on the KV fingerprint and the engine hash, so engines serving
  the same model find each other's blocks. The tier lists (and publishes) the blocks *this* engine
  stored or found there; a bound, if set, evicts this engine's own claims LRU.

DISK files and EXTERNAL values carry a header with the block's hash, parent and token ids, so a
load verifies it got the block it asked for (a corrupt or colliding value is dropped, not used).
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine.stores import ExternalStore, TierError, atomic_write

__all__ = [
    "BlockMeta",
    "DiskTier",
    "ExternalStore",
    "ExternalTier",
    "HostEntry",
    "HostPool",
    "TierError",
    "decode_block",
    "encode_block",
]


@dataclass(frozen=True)
class BlockMeta:
    """What a lower-tier ``BlockStored`` needs and a load verifies."""

    hash: int
    parent: int | None
    token_ids: tuple[int, ...]


_HEAD = struct.Struct(">4sQBQI")  # magic, hash, has_parent, parent, n_tokens
_MAGIC = b"KVR1"


def encode_block(meta: BlockMeta, kv: bytes) -> bytes:
    head = _HEAD.pack(
        _MAGIC, meta.hash, meta.parent is not None, meta.parent or 0, len(meta.token_ids)
    )
    return head + array("q", meta.token_ids).tobytes() + kv


def decode_block(data: bytes) -> tuple[BlockMeta, bytes]:
    if len(data) < _HEAD.size:
        raise TierError("stored block is truncated")
    magic, h, has_parent, parent, n = _HEAD.unpack_from(data)
    end = _HEAD.size + 8 * n
    if magic != _MAGIC or len(data) < end:
        raise TierError("stored block has a bad header")
    tokens = array("q")
    tokens.frombytes(data[_HEAD.size : end])
    return BlockMeta(h, parent if has_parent else None, tuple(tokens)), data[end:]


# ---------------------------------------------------------------------------------- CPU_PINNED


@dataclass
class HostEntry:
    slot: int
    meta: BlockMeta
    ready: bool = False  # the GPU→host copy completed (only then is it listed/published)
    pins: int = 0  # loads reading the slot


@dataclass
class HostPool:
    capacity: int
    staging: int
    entries: dict[int, HostEntry] = field(default_factory=dict)
    _lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # ready, unpinned-or-not
    _free: list[int] = field(default_factory=list)
    _free_staging: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))
        self._free_staging = list(range(self.capacity + self.staging - 1, self.capacity - 1, -1))

    @property
    def num_slots(self) -> int:
        return self.capacity + self.staging

    def hashes(self) -> set[int]:
        return {h for h, e in self.entries.items() if e.ready}

    @property
    def num_ready(self) -> int:
        return len(self._lru)

    def get(self, h: int) -> HostEntry | None:
        e = self.entries.get(h)
        return e if e is not None and e.ready else None

    def has_free(self) -> bool:
        return bool(self._free)

    def victim(self) -> HostEntry | None:
        """Least recently used ready block no load is reading."""
        for h in self._lru:
            e = self.entries[h]
            if e.pins == 0:
                return e
        return None

    def reserve(self, meta: BlockMeta) -> HostEntry:
        """Take a free slot for an incoming copy (caller evicts first when none is free)."""
        e = HostEntry(self._free.pop(), meta)
        self.entries[meta.hash] = e
        return e

    def complete(self, e: HostEntry) -> None:
        e.ready = True
        self._lru[e.meta.hash] = None

    def touch(self, h: int) -> None:
        if h in self._lru:
            self._lru.move_to_end(h)

    def release(self, h: int) -> HostEntry:
        e = self.entries.pop(h)
        self._lru.pop(h, None)
        self._free.append(e.slot)
        return e

    @property
    def num_free_staging(self) -> int:
        return len(self._free_staging)

    def take_staging(self) -> int | None:
        return self._free_staging.pop() if self._free_staging else None

    def give_staging(self, slot: int) -> None:
        self._free_staging.append(slot)

    def clear(self) -> None:
        for h in [h for h, e in self.entries.items() if e.pins == 0]:
            self.release(h)


# ---------------------------------------------------------------------------------- DISK


class DiskTier:
    def __init__(self, directory: str | os.PathLike[str], capacity: int, fingerprint: str) -> None:
        if capacity <= 0:
            raise TierError("--disk-blocks must be positive")
        self.dir = Path(directory)
        self.capacity = capacity
        self._prefix = f"kv-{_slug(fingerprint)}-"
        self.entries: OrderedDict[int, BlockMeta] = OrderedDict()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for p in self.dir.glob("kv-*.blk"):
                p.unlink()
        except OSError as exc:
            raise TierError(f"cannot use disk directory {self.dir}: {exc}") from exc

    def path(self, h: int) -> Path:
        return self.dir / f"{self._prefix}{h:016x}.blk"

    def hashes(self) -> set[int]:
        return set(self.entries)

    def files(self) -> set[int]:
        """Hashes of the block files actually on disk (what the debug listing shows)."""
        n = len(self._prefix)
        return {int(p.name[n:-4], 16) for p in self.dir.glob(f"{self._prefix}*.blk")}

    def __contains__(self, h: int) -> bool:
        return h in self.entries

    def full(self) -> bool:
        return len(self.entries) >= self.capacity

    def victim(self) -> BlockMeta:
        return next(iter(self.entries.values()))

    def write(self, meta: BlockMeta, kv: bytes) -> None:
        atomic_write(self.path(meta.hash), encode_block(meta, kv))
        self.entries[meta.hash] = meta

    def read(self, h: int) -> bytes:
        try:
            data = self.path(h).read_bytes()
        except OSError as exc:
            raise TierError(f"cannot read disk block {h:016x}: {exc}") from exc
        meta, kv = decode_block(data)
        if meta.hash != h:
            raise TierError(f"disk block {h:016x} holds block {meta.hash:016x}")
        self.entries.move_to_end(h)
        return kv

    def delete(self, h: int) -> BlockMeta:
        meta = self.entries.pop(h)
        try:
            self.path(h).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TierError(f"cannot delete disk block {h:016x}: {exc}") from exc
        return meta

    def clear(self) -> None:
        for h in list(self.entries):
            self.delete(h)


# ---------------------------------------------------------------------------------- EXTERNAL


class ExternalTier:
    def __init__(self, store: ExternalStore, fingerprint: str, capacity: int | None = None) -> None:
        self.store = store
        self.capacity = capacity
        self._prefix = f"kvrouter:{_slug(fingerprint)}:"
        self.entries: OrderedDict[int, BlockMeta] = OrderedDict()  # this engine's claims

    def key(self, h: int) -> str:
        return f"{self._prefix}{h:016x}"

    def hashes(self) -> set[int]:
        return set(self.entries)

    def __contains__(self, h: int) -> bool:
        return h in self.entries

    def full(self) -> bool:
        return self.capacity is not None and len(self.entries) >= self.capacity

    def victim(self) -> BlockMeta:
        return next(iter(self.entries.values()))

    def present(self, hashes: Iterable[int]) -> list[bool]:
        """Which blocks the shared store holds (stored by any engine)."""
        return self.store.exists([self.key(h) for h in hashes])

    def write(self, meta: BlockMeta, kv: bytes) -> None:
        if not self.present([meta.hash])[0]:
            self.store.put(self.key(meta.hash), encode_block(meta, kv))
        self.entries[meta.hash] = meta

    def read(self, h: int) -> tuple[BlockMeta, bytes] | None:
        data = self.store.get(self.key(h))
        if data is None:
            return None
        meta, kv = decode_block(data)
        if meta.hash != h:
            raise TierError(f"external block {h:016x} holds block {meta.hash:016x}")
        if h in self.entries:
            self.entries.move_to_end(h)
        return meta, kv

    def forget(self, h: int, *, delete: bool) -> BlockMeta:
        meta = self.entries.pop(h)
        if delete:
            self.store.delete(self.key(h))
        return meta

    def clear(self) -> None:
        # the data stays: other engines of the pool may be using it
        self.entries.clear()


def _slug(fingerprint: str) -> str:
    return hashlib.blake2b(fingerprint.encode(), digest_size=6).hexdigest()
