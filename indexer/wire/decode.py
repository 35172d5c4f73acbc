"""Decoding one KV event message, fast path: typed msgspec structs, then normalized events.

Two shapes exist on the wire and msgspec cannot put both in one tagged union (a union may not mix
``array_like`` and map structs), so there is one batch decoder per shape and the first event's
msgpack header picks one. Unknown keys and extra trailing positional fields are ignored by msgspec
itself. Anything the typed decoders reject (unknown event types, mixed shapes, bad data) goes to
:mod:`indexer.wire.loose`, which is the authority on what a payload means: it skips and counts
unknown events and raises the precise, field-naming errors. The fast path only has to agree with it
whenever it succeeds, and it does the per-message work of the ingest hot path in C.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from ..events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch, canonical_tier
from .errors import FrameError
from .frames import unpack_seq
from .loose import decode_loose

__all__ = ["decode_message", "decode_payload"]

_Hash = int | bytes
_BlockSize = Annotated[int, Meta(gt=0)]
_Rank = Annotated[int, Meta(ge=0)]


# Positional events (vLLM <= 0.23, SGLang <= 0.5.19): the class name is the first element, then
# the fields in this order. Later releases append fields; those trailing extras are ignored.
class _ArrStored(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: _BlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None


class _ArrRemoved(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int = 0


class _ArrCleared(Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _ArrBatch(Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrStored | _ArrRemoved | _ArrCleared]
    dp_rank: _Rank | None = None


# Map events (vLLM >= 0.24, SGLang >= 0.5.20): keyed by field name, "type" = class name.
class _MapStored(Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: _BlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None


class _MapRemoved(Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int = 0


class _MapCleared(Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _MapBatch(Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    dp_rank: _Rank | None = None


_ARRAY_DECODER = msgspec.msgpack.Decoder(_ArrBatch)
_MAP_DECODER = msgspec.msgpack.Decoder(_MapBatch)

_STORED = (_ArrStored, _MapStored)
_REMOVED = (_ArrRemoved, _MapRemoved)


#: msgpack header bytes that open an array (fixarray 1-15, array16, array32).
_ARRAY_HEADERS = frozenset([*range(0x91, 0xA0), 0xDC, 0xDD])


def _events_are_arrays(p: bytes) -> bool:
    """Peek at the first event's msgpack header: True when it is an array (positional event).

    Covers the layouts publishers produce (fixarray batch, float64/float32/fixint ts); anything
    else picks the map decoder, and a wrong pick only costs a trip through the loose decoder.
    """
    if len(p) > 11 and p[1] == 0xCB and 0x91 <= p[10] <= 0x9F:
        # What every publisher sends: [float64 ts, fixarray events, ...]; first event at 11.
        return p[11] in _ARRAY_HEADERS
    if len(p) < 4 or p[0] not in (0x92, 0x93):
        return False
    t = p[1]
    i = 10 if t == 0xCB else 6 if t == 0xCA else 2 if t < 0x80 else 0
    if not i or i >= len(p):
        return False
    h = p[i]
    i += 1 if 0x91 <= h <= 0x9F else 3 if h == 0xDC else 5 if h == 0xDD else len(p)
    return i < len(p) and p[i] in _ARRAY_HEADERS


def _kind(kind: str | None) -> str | None:
    # None stands for a full-attention group, the one kind every publisher had before the field
    return None if kind == "full_attention" else kind


def _tier(medium: str | None) -> str:
    return "GPU" if medium is None or medium == "GPU" else canonical_tier(medium)


def decode_payload(payload: bytes, *, seq: int = 0, topic: bytes = b"") -> EventBatch:
    """Decode a payload ``[ts, events, dp_rank]`` into a normalized :class:`EventBatch`.

    Raises :class:`PayloadError` for bytes that are not one msgpack value and
    :class:`SchemaError` for msgpack of the wrong shape. Events of unknown types are skipped and
    counted in ``EventBatch.unknown_events``.
    """
    decoder = _ARRAY_DECODER if _events_are_arrays(payload) else _MAP_DECODER
    try:
        batch = decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        # ValidationError is a DecodeError too. The loose decoder re-reads the payload and either
        # decodes it (unknown event types, mixed shapes) or raises the typed error naming the fault.
        return decode_loose(payload, seq=seq, topic=topic)
    events: list[Event] = []
    append = events.append
    for e in batch.events:
        if isinstance(e, _STORED):
            append(
                BlockStored(
                    block_hashes=e.block_hashes,
                    parent_block_hash=e.parent_block_hash,
                    token_ids=e.token_ids,
                    block_size=e.block_size,
                    tier=_tier(e.medium),
                    medium=e.medium,
                    lora_id=e.lora_id,
                    lora_name=e.lora_name,
                    extra_keys=e.extra_keys if e.extra_keys and any(e.extra_keys) else None,
                    group_idx=e.group_idx,
                    kv_cache_spec_kind=_kind(e.kv_cache_spec_kind),
                )
            )
        elif isinstance(e, _REMOVED):
            append(
                BlockRemoved(
                    block_hashes=e.block_hashes,
                    tier=_tier(e.medium),
                    medium=e.medium,
                    group_idx=e.group_idx,
                )
            )
        else:
            append(AllBlocksCleared())
    return EventBatch(seq=seq, ts=batch.ts, events=events, dp_rank=batch.dp_rank, topic=topic)


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """Decode one ZMQ message ``[topic, seq (8-byte big-endian), payload]``.

    Raises :class:`FrameError` for a wrong frame count or sequence frame length, otherwise as
    :func:`decode_payload`.
    """
    if len(frames) != 3:
        raise FrameError(f"message must have 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_frame, payload = frames
    return decode_payload(payload, seq=unpack_seq(seq_frame), topic=bytes(topic))
