"""Decoding one KV event payload, reference path: generic msgpack, then checked by hand.

This is the authority on what a payload means. The typed fast path in :mod:`indexer.wire.decode`
falls back here whenever msgspec rejects a payload, so that unknown event types are skipped and
counted instead of failing the batch, both event shapes may share a batch, and every rejection
says which layer and which field was wrong. It is slow (one Python object per msgpack value) and
only runs for the unusual messages.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch, canonical_tier
from .errors import PayloadError, SchemaError

__all__ = ["POSITIONAL_FIELDS", "decode_loose"]

_ANY_DECODER = msgspec.msgpack.Decoder()

#: Field order of positional events after the class name, and how many of them are required.
#: Releases append fields at the end; extra trailing fields are ignored.
POSITIONAL_FIELDS: dict[str, tuple[tuple[str, ...], int]] = {
    "BlockStored": (
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
        ),
        4,
    ),
    "BlockRemoved": (("block_hashes", "medium", "group_idx"), 1),
    "AllBlocksCleared": ((), 0),
}


def _kind(value: object) -> str:
    """The msgpack-ish name of a value's type, for error messages."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bytes, bytearray)):
        return "bin"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "map"
    if isinstance(value, msgspec.msgpack.Ext):
        return f"ext (type {value.code})"
    return type(value).__name__


def _is_hash(value: object) -> bool:
    # ``type(...) is`` on purpose: msgpack booleans decode to bool, a subclass of int.
    return type(value) is int or type(value) is bytes


def _hashes(value: object, where: str) -> list[int | bytes]:
    if not isinstance(value, list):
        raise SchemaError(
            f"{where}.block_hashes must be an array of int or bin, got {_kind(value)}"
        )
    for j, h in enumerate(value):
        if not _is_hash(h):
            raise SchemaError(f"{where}.block_hashes[{j}] must be int or bin, got {_kind(h)}")
    return value


def _optional(value: object, typ: type, where: str, name: str) -> Any:
    if value is not None and type(value) is not typ:
        raise SchemaError(f"{where}.{name} must be {typ.__name__} or nil, got {_kind(value)}")
    return value


def _stored(f: dict[str, Any], where: str) -> BlockStored:
    hashes = _hashes(f["block_hashes"], where)
    parent = f["parent_block_hash"]
    if parent is not None and not _is_hash(parent):
        raise SchemaError(f"{where}.parent_block_hash must be int, bin or nil, got {_kind(parent)}")
    tokens = f["token_ids"]
    if not isinstance(tokens, list):
        raise SchemaError(f"{where}.token_ids must be an array of int, got {_kind(tokens)}")
    for j, t in enumerate(tokens):
        if type(t) is not int:
            raise SchemaError(f"{where}.token_ids[{j}] must be int, got {_kind(t)}")
    size = f["block_size"]
    if type(size) is not int:
        raise SchemaError(f"{where}.block_size must be int, got {_kind(size)}")
    if size <= 0:
        raise SchemaError(f"{where}.block_size must be positive, got {size}")
    medium = _optional(f.get("medium"), str, where, "medium")
    extra = _optional(f.get("extra_keys"), list, where, "extra_keys")
    kind = _optional(f.get("kv_cache_spec_kind"), str, where, "kv_cache_spec_kind")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        tier=canonical_tier(medium),
        medium=medium,
        lora_id=_optional(f.get("lora_id"), int, where, "lora_id"),
        lora_name=_optional(f.get("lora_name"), str, where, "lora_name"),
        extra_keys=extra if extra and any(extra) else None,
        group_idx=_group(f, where),
        kv_cache_spec_kind=None if kind == "full_attention" else kind,
    )


def _group(f: dict[str, Any], where: str) -> int:
    g = f.get("group_idx")
    if g is None:
        return 0
    if type(g) is not int:
        raise SchemaError(f"{where}.group_idx must be int or nil, got {_kind(g)}")
    return g


def _removed(f: dict[str, Any], where: str) -> BlockRemoved:
    hashes = _hashes(f["block_hashes"], where)
    medium = _optional(f.get("medium"), str, where, "medium")
    return BlockRemoved(
        block_hashes=hashes, tier=canonical_tier(medium), medium=medium, group_idx=_group(f, where)
    )


def _fields(event: object, where: str) -> tuple[str, dict[str, Any]] | None:
    """The event's type name and its fields by name; None for an unknown type."""
    if isinstance(event, list):
        if not event:
            raise SchemaError(f"{where} is an empty array, expected [type, fields...]")
        name = event[0]
        if not isinstance(name, str):
            raise SchemaError(f"{where}[0] (event type) must be str, got {_kind(name)}")
        layout = POSITIONAL_FIELDS.get(name)
        if layout is None:
            return None
        names, required = layout
        if len(event) - 1 < required:
            raise SchemaError(
                f"{where}: positional {name} has {len(event) - 1} field(s), needs at least "
                f"{required} ({', '.join(names[:required])})"
            )
        return name, dict(zip(names, event[1:]))
    if isinstance(event, dict):
        for key in event:
            if not isinstance(key, str):
                raise SchemaError(
                    f"{where} has a non-str key {key!r} ({_kind(key)}); keys must be str"
                )
        if "type" not in event:
            raise SchemaError(f"{where} has no 'type' key")
        name = event["type"]
        if not isinstance(name, str):
            raise SchemaError(f"{where}.type must be str, got {_kind(name)}")
        layout = POSITIONAL_FIELDS.get(name)
        if layout is None:
            return None
        names, required = layout
        for key in names[:required]:
            if key not in event:
                raise SchemaError(f"{where}: {name} has no '{key}' key")
        return name, event
    raise SchemaError(f"{where} must be a map or an array, got {_kind(event)}")


def decode_loose(payload: bytes, *, seq: int = 0, topic: bytes = b"") -> EventBatch:
    """Decode ``[ts, events, dp_rank]`` with full checks; same result as the fast path."""
    try:
        obj = _ANY_DECODER.decode(payload)
    except RecursionError as exc:
        # Valid msgpack nested deeper than any event is: a shape error, raised cleanly.
        raise SchemaError("payload nests deeper than the decoder's recursion limit") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # bad UTF-8 is UnicodeDecodeError before msgspec 0.23, "Invalid UTF-8 ..." from 0.23 on
        utf8 = isinstance(exc, UnicodeDecodeError) or "UTF-8" in str(exc)
        what = f"invalid UTF-8 in a str ({exc})" if utf8 else str(exc)
        raise PayloadError(f"payload is not valid msgpack: {what}") from exc
    if not isinstance(obj, list):
        raise SchemaError(f"payload must be an array [ts, events, dp_rank], got {_kind(obj)}")
    if len(obj) < 2:
        raise SchemaError(
            f"payload array has {len(obj)} element(s), expected [ts, events, dp_rank]"
        )
    ts = obj[0]
    if type(ts) is not float and type(ts) is not int:
        raise SchemaError(f"ts must be a number, got {_kind(ts)}")
    raw_events = obj[1]
    if not isinstance(raw_events, list):
        raise SchemaError(f"events must be an array, got {_kind(raw_events)}")
    dp_rank = obj[2] if len(obj) > 2 else None
    if dp_rank is not None:
        if type(dp_rank) is not int:
            raise SchemaError(f"dp_rank must be int or nil, got {_kind(dp_rank)}")
        if dp_rank < 0:
            raise SchemaError(f"dp_rank must be >= 0, got {dp_rank}")
    events: list[Event] = []
    unknown = 0
    for i, raw in enumerate(raw_events):
        where = f"events[{i}]"
        found = _fields(raw, where)
        if found is None:
            unknown += 1
            continue
        name, f = found
        where = f"{where} {name}"
        if name == "BlockStored":
            events.append(_stored(f, where))
        elif name == "BlockRemoved":
            events.append(_removed(f, where))
        else:
            events.append(AllBlocksCleared())
    return EventBatch(
        seq=seq,
        ts=float(ts),
        events=events,
        dp_rank=dp_rank,
        topic=topic,
        unknown_events=unknown,
    )
