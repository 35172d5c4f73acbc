"""The router's shared vocabulary, at the bottom of its layers: what the placement core, the fleet
and the edge all speak of. Nothing here does I/O or imports another router module.

- :data:`WorkerKey` — one worker *rank*, ``(worker_id, dp_rank)``: the unit the index, the load
  ledger and the scorer count in (a *worker* is the process with a URL; it has ``dp_ranks`` ranks).
  Defined once, by the index (:mod:`indexer.index.types`), and re-exported here.
- :class:`ScrapedLoad` — the load a worker reports on its own ``/metrics``.
- :func:`worker_hash` — a rank's stable hash, the same in every router process.
"""

from __future__ import annotations

import zlib

import msgspec

from indexer.events import CANONICAL_TIERS
from indexer.index.types import WorkerKey

__all__ = ["CANONICAL_TIERS", "ScrapedLoad", "WorkerKey", "worker_hash"]


class ScrapedLoad(msgspec.Struct, frozen=True):
    """Load a worker reports on its own ``/metrics`` (vLLM / SGLang names)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # fraction in [0, 1]


def worker_hash(key: WorkerKey) -> int:
    """Stable across processes (``hash(str)`` is salted per process, crc32 is not)."""
    return zlib.crc32(f"{key[0]}\x00{key[1]}".encode())
