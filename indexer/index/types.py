"""The index's vocabulary: worker keys (``WorkerKey``, the one definition the router imports too),
tier ids, the answers of ``match``, the per-worker record and errors. Nothing here knows how the
index is stored or walked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from indexer.events import CANONICAL_TIERS, BlockStored, EngineHash
from indexer.hashing import namespace_seed

__all__ = [
    "EXTERNAL",
    "GPU",
    "MAX_TIERS",
    "MAX_UNKNOWN_MEDIUMS",
    "SGLANG_ROOT_PARENT",
    "ZERO",
    "IndexError_",
    "MatchResult",
    "PagedBlocks",
    "RankRecord",
    "SnapshotError",
    "WorkerIndexStats",
    "WorkerKey",
    "WorkerMatch",
]

#: One worker rank: ``(worker_id, dp_rank)``.
WorkerKey = tuple[str, int]

#: SGLang 0.4.9 sends ``hash(())`` as the parent of a page hanging off the radix root.
SGLANG_ROOT_PARENT = 5740354900026072187

#: Tier ids are positions in ``CANONICAL_TIERS`` (fastest first), then unknown mediums; a tier
#: mask has bit ``t`` for tier ``t``.
GPU = CANONICAL_TIERS.index("GPU")
EXTERNAL = CANONICAL_TIERS.index("EXTERNAL")
#: Bits of a per-(block, worker) tier mask: at most this many tiers, unknown ones included.
MAX_TIERS = 16
#: Distinct unknown ``medium`` names counted by name per worker; more are counted as ``OTHER``.
MAX_UNKNOWN_MEDIUMS = 32


class IndexError_(Exception):
    """Base class of the index's own errors (named to avoid shadowing the builtin)."""


class SnapshotError(IndexError_):
    """A snapshot file that cannot be loaded: wrong format, version or block size."""


class WorkerMatch(msgspec.Struct, frozen=True):
    matched_blocks: int
    by_tier: dict[str, int]
    predicted_blocks: int = 0


class MatchResult(msgspec.Struct, frozen=True):
    request_blocks: int
    workers: dict[WorkerKey, WorkerMatch]


@dataclass
class WorkerIndexStats:
    """Counters of one worker rank; ``blocks_by_tier`` counts engine blocks per tier."""

    blocks_by_tier: dict[str, int] = field(default_factory=dict)
    stored_events: int = 0
    removed_events: int = 0
    cleared: int = 0
    orphans: int = 0
    orphan_blocks: int = 0
    unknown_removals: int = 0
    #: Stores of a hash already held on that tier (counted; one removal each before it leaves).
    duplicate_stores: int = 0
    #: Events of partial-prefix KV cache groups (sliding window, Mamba): counted, not applied.
    partial_group_events: int = 0
    #: Entries dropped by the global cap (``max_index_entries``), least recently used first.
    evicted_entries: int = 0
    #: Entries dropped by this rank's own cap (its KV capacity, else the default per rank).
    rank_evicted_entries: int = 0
    #: This rank's cap in entries now (0: none), and where it comes from: "capacity" (the
    #: worker's KV capacity times the margin), "default" (the default per rank) or "".
    max_entries: int = 0
    cap_source: str = ""
    #: Events with an unknown ``medium``, by name (bounded, see ``MAX_UNKNOWN_MEDIUMS``).
    unknown_mediums: dict[str, int] = field(default_factory=dict)
    #: Where the rank's entries come from: "events" (its KV events) or "approximate" (what the
    #: router sent there, ``indexer.index.approx``); and what that tree forgot at its cap.
    source: str = "events"
    forgotten_entries: int = 0


class PagedBlocks(Protocol):
    """What the rest of the index sees of one worker's engine blocks whose page size is not the
    router block size (``rechunk.RechunkTable``). A protocol so that ``RankRecord`` names the table
    without importing its module, which imports this one."""

    @property
    def blocks(self) -> Mapping[EngineHash, Any]: ...

    @property
    def cover(self) -> Mapping[int, list[EngineHash]]: ...

    @property
    def tier_counts(self) -> list[int]: ...

    def store(self, ev: BlockStored) -> None: ...

    def remove(self, e: EngineHash, t: int) -> None: ...

    def evict(self, e: EngineHash) -> None: ...

    def renew(self, e: EngineHash) -> None: ...


class RankRecord:
    """One worker rank's record: its engine blocks, their tiers and its counters."""

    __slots__ = (
        "approximate",
        "bit",
        "cap",
        "cap_warned",
        "capacity",
        "counted",
        "dups",
        "emask",
        "key",
        "model",
        "multi",
        "page",
        "partial_groups",
        "rechunk",
        "slot",
        "stats",
        "table",
        "tier_counts",
    )

    def __init__(self, key: WorkerKey, slot: int, model: str) -> None:
        self.key = key
        self.slot = slot
        self.bit = 1 << slot
        self.model = model
        # engine hash -> router hash. The router hash object is also the global map's key when
        # this worker brought the block in, so a GPU-only entry costs one dict slot and one int.
        self.table: dict[EngineHash, int] = {}
        # engine hash -> its tier mask, only for blocks not held on GPU alone (mask != 1)
        self.emask: dict[EngineHash, int] = {}
        # router hash -> {engine hash | None: tier mask} for the rare router block that several
        # engine blocks of this worker map to (same tokens, different cache salt or extra keys).
        # ``None`` stands for the engine blocks that held it before the collision was seen.
        self.multi: dict[int, dict[EngineHash | None, int]] = {}
        self.rechunk: PagedBlocks | None = None
        self.tier_counts: list[int] = [0] * MAX_TIERS
        self.stats = WorkerIndexStats()
        #: engine hash -> {tier: stores beyond the first}, for hashes stored more than once
        self.dups: dict[EngineHash, dict[int, int]] = {}
        #: the engine's page size in tokens when it differs from the router block size, else 0
        self.page = 0
        #: group_idx values seen with a partial-prefix kv_cache_spec_kind
        self.partial_groups: set[int] = set()
        #: Entries past which the applier asks the evictor about this rank (0: never): where
        #: it nears its cap; its KV capacity by tier id (engine blocks) when the worker said it;
        #: warned about its cap; its entries as ``IndexState.counted_total`` last counted them
        self.cap = 0
        self.capacity: dict[int, int] | None = None
        self.cap_warned = False
        self.counted = 0
        #: no events: the entries are the blocks the router sent here (``indexer.index.approx``)
        self.approximate = False

    def entries(self) -> int:
        """(engine block) entries of this rank, re-chunked ones included: what its cap counts."""
        n = len(self.table)
        if self.rechunk is not None:
            n += len(self.rechunk.blocks)
        return n

    def seed(self, lora_name: str | None, lora_id: int | None) -> int:
        """Root of this worker's chains for a LoRA adapter (one known by id only is named by it)."""
        if lora_name is None and lora_id is not None:
            lora_name = f"lora-id:{lora_id}"
        return namespace_seed(self.model, lora_name)


ZERO = WorkerMatch(0, {})
