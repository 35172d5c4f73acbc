"""Normalized KV cache events: what the wire decoder produces and the index applies.

These are the router's own types, independent of which publisher (vLLM or SGLang, array or map
encoding) sent the bytes. Engine block hashes stay opaque: ``int`` (vLLM unsigned, SGLang signed)
or ``bytes`` (32-byte digests); they are only ever compared within one worker.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "CANONICAL_TIERS",
    "DEFAULT_TIER_WEIGHTS",
    "FULL_PREFIX_KINDS",
    "TIER_ALIASES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineHash",
    "Event",
    "EventBatch",
    "ResumePoint",
    "canonical_tier",
]

EngineHash = int | bytes

#: Fastest first. Scoring weights and "a block counts at its fastest tier" follow this order.
CANONICAL_TIERS: tuple[str, ...] = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")

#: Default scoring weight of a block per tier, in ``CANONICAL_TIERS`` order (a matched block
#: saves that fraction of its prefill); unknown tiers are weighted like EXTERNAL.
DEFAULT_TIER_WEIGHTS: dict[str, float] = dict(
    zip(CANONICAL_TIERS, (1.0, 0.8, 0.5, 0.3), strict=True)
)

#: ``kv_cache_spec_kind`` values whose group keeps every block of a prefix. Blocks of other
#: groups (sliding window, chunked local attention, Mamba state: partial prefixes) do not make a
#: prefix present on their own; see ``indexer.index`` for the rule.
FULL_PREFIX_KINDS: frozenset[str | None] = frozenset(
    {None, "full_attention", "mla_attention", "cross_attention", "encoder_only_attention"}
)

#: Publishers' ``medium`` names -> canonical tier (each canonical name maps to itself).
TIER_ALIASES: dict[str, str] = {
    **{t: t for t in CANONICAL_TIERS},
    "DEVICE": "GPU",
    "CPU": "CPU_PINNED",
    "CPU_TIER1": "CPU_PINNED",
    "HOST": "CPU_PINNED",
    "CPU_TIER2": "DISK",
    "STORAGE": "DISK",
    "NVME": "DISK",
    "FS": "DISK",
    "REMOTE": "EXTERNAL",
    "SHARED": "EXTERNAL",
    "OBJ": "EXTERNAL",
}


def canonical_tier(medium: str | None) -> str:
    """Map a publisher's free-text ``medium`` to a canonical tier.

    Absent/None means GPU (releases before ``medium`` existed only reported GPU blocks). An unknown
    medium keeps its own (upper-cased) name: it is scored like EXTERNAL and counted, never silently
    treated as GPU.
    """
    if medium is None:
        return "GPU"
    key = medium.strip().upper()
    return TIER_ALIASES.get(key, key)


class BlockStored(msgspec.Struct, frozen=True, tag=True, gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    tier: str = "GPU"
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    #: Per block, the engine's extra hash keys (LoRA, multimodal hashes, cache salt), or None when
    #: no block has any (decoders normalize a list of nils to None).
    extra_keys: list[Any] | None = None
    #: The engine's KV cache group (hybrid models publish one stream of blocks per group).
    group_idx: int = 0
    #: None: full attention (decoders map the wire's "full_attention" to None).
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, tag=True, gc=False):
    block_hashes: list[EngineHash]
    tier: str = "GPU"
    medium: str | None = None
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One ZMQ message: ``[topic, seq, payload]`` with payload ``[ts, events, dp_rank]``."""

    seq: int
    ts: float
    events: list[Event]
    dp_rank: int | None = None
    topic: bytes = b""
    #: Events of a type this decoder does not know: skipped, counted here.
    unknown_events: int = 0


class ResumePoint(int):
    """A worker rank's last applied seq (the int itself) and the ``ts`` of that batch, which
    tells, on resume, whether the publisher still is the process that seq came from."""

    ts: float | None

    def __new__(cls, seq: int, ts: float | None = None) -> ResumePoint:
        self = super().__new__(cls, seq)
        self.ts = ts
        return self
