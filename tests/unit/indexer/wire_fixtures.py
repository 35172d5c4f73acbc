"""Loading the captured wire fixtures (tests/fixtures/wire, schema in its README.md).

Shared by the wire tests and anything else that replays the captured streams (index, subscriber):
file lists, frames as bytes, and the README's normalized form of a decoded batch so that it can be
compared with a file's ``expected.messages`` entry.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch

FIXTURE_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "wire"

STREAM_FORMAT = "kv-event-wire-stream/1"
REPLAY_FORMAT = "kv-event-wire-replay/1"
MALFORMED_FORMAT = "kv-event-wire-malformed/1"


@cache
def load(name: str) -> dict[str, Any]:
    """One fixture file, parsed (cached: treat the result as read-only)."""
    with open(FIXTURE_DIR / name, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _files(fmt: str) -> list[str]:
    return [p.name for p in sorted(FIXTURE_DIR.glob("*.json")) if load(p.name)["format"] == fmt]


def stream_files() -> list[str]:
    return _files(STREAM_FORMAT)


def replay_files() -> list[str]:
    return _files(REPLAY_FORMAT)


def frames(frames_hex: list[str]) -> list[bytes]:
    return [bytes.fromhex(x) for x in frames_hex]


def stream_frames(name: str) -> list[list[bytes]]:
    """Every message of a stream file, as the frames a SUB socket received."""
    return [frames(m["frames_hex"]) for m in load(name)["messages"]]


def hash_str(h: int | bytes | None) -> str | None:
    """README normalization of an engine hash: int in decimal, bin as lowercase hex."""
    if h is None:
        return None
    return h.hex() if isinstance(h, bytes) else str(h)


def parse_hash(s: str | None, hash_repr: str) -> int | bytes | None:
    """The inverse of :func:`hash_str`, for a file's ``hash_repr`` ("int" or "bytes")."""
    if s is None:
        return None
    return bytes.fromhex(s) if hash_repr == "bytes" else int(s)


def normalize_event(e: Event, dp_rank: int | None) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        return {
            "type": "BlockStored",
            "dp_rank": dp_rank,
            "block_hashes": [hash_str(h) for h in e.block_hashes],
            "parent_block_hash": hash_str(e.parent_block_hash),
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "medium": e.medium,
            "tier": e.tier,
            "lora_id": e.lora_id,
            "lora_name": e.lora_name,
        }
    if isinstance(e, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "dp_rank": dp_rank,
            "block_hashes": [hash_str(h) for h in e.block_hashes],
            "medium": e.medium,
            "tier": e.tier,
        }
    assert isinstance(e, AllBlocksCleared), e
    return {"type": "AllBlocksCleared", "dp_rank": dp_rank}


def normalize_batch(batch: EventBatch) -> dict[str, Any]:
    """A decoded batch in the shape of ``expected.messages[k]`` (without its ``step`` label)."""
    return {
        "seq": batch.seq,
        "ts": batch.ts,
        "dp_rank": batch.dp_rank,
        "events": [normalize_event(e, batch.dp_rank) for e in batch.events],
    }
