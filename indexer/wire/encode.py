"""Encoding KV events the way vLLM 0.33.0 publishes them (the map format of vLLM >= 0.24).

The bundled engine and the tests publish with this, so any vLLM-compatible subscriber reads our
events. The structs below mirror vLLM 0.33.0's own msgspec event structs field for field, with the
same defaults and ``omit_defaults``: that is what makes the bytes identical, down to the ``map16``
header msgspec writes for a struct of 16 or more keys and the optional fields it leaves out. Fields
the normalized events do not carry get the values vLLM sends for a plain full-attention cache:
``extra_keys`` one nil per block, ``group_idx`` 0, ``kv_cache_spec_kind`` "full_attention".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import Struct

from ..events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from .frames import pack_seq

__all__ = ["encode_message", "encode_payload"]

_Hash = int | bytes


class _V33BlockStored(Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class _V33BlockRemoved(Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[_Hash]
    medium: str | None
    group_idx: int
    locality: Any = None
    ownership: Any = None


class _V33AllBlocksCleared(Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _V33Batch(Struct, array_like=True, gc=False):
    ts: float
    events: list[_V33BlockStored | _V33BlockRemoved | _V33AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def _wire_medium(medium: str | None, tier: str) -> str | None:
    # The wire carries only ``medium``. An event built with a tier but no medium (as the engine
    # may) sends the tier's name so that a decoder recovers the same tier; GPU stays nil.
    if medium is not None:
        return medium
    return None if tier == "GPU" else tier


def encode_payload(events: Sequence[Event], *, ts: float, dp_rank: int | None = 0) -> bytes:
    """Encode ``[ts, events, dp_rank]`` with map events, byte-identical to vLLM 0.33.0.

    ``dp_rank=None`` sends nil as the rank, as vLLM does without data parallelism.
    ``decode_payload(encode_payload(events, ...)).events == events`` for normalized events
    (``tier == canonical_tier(medium)``).
    """
    out: list[_V33BlockStored | _V33BlockRemoved | _V33AllBlocksCleared] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(
                _V33BlockStored(
                    block_hashes=e.block_hashes,
                    parent_block_hash=e.parent_block_hash,
                    token_ids=e.token_ids,
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=_wire_medium(e.medium, e.tier),
                    lora_name=e.lora_name,
                    extra_keys=(
                        e.extra_keys if e.extra_keys is not None else [None] * len(e.block_hashes)
                    ),
                    group_idx=e.group_idx,
                    kv_cache_spec_kind=(
                        "full_attention" if e.kv_cache_spec_kind is None else e.kv_cache_spec_kind
                    ),
                )
            )
        elif isinstance(e, BlockRemoved):
            out.append(
                _V33BlockRemoved(
                    block_hashes=e.block_hashes,
                    medium=_wire_medium(e.medium, e.tier),
                    group_idx=e.group_idx,
                )
            )
        elif isinstance(e, AllBlocksCleared):
            out.append(_V33AllBlocksCleared())
        else:
            raise TypeError(f"cannot encode {type(e).__name__}: not a KV cache event")
    return _ENCODER.encode(_V33Batch(ts=float(ts), events=out, data_parallel_rank=dp_rank))


def encode_message(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The frames of one published message: ``[topic, seq (8-byte big-endian), payload]``."""
    if seq < 0:
        raise ValueError(f"a message sequence number must be >= 0, got {seq}")
    return [topic, pack_seq(seq), payload]
