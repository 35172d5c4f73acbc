"""The block pull on the wire: one request frame from the decode engine, one answer frame from
the prefill engine, each a 4-byte big-endian length and a msgpack body, on one TCP connection.

Every size a peer controls is bounded before it is read: a request frame by
:data:`MAX_REQUEST_BYTES`, an answer by what the decode engine asked for (its block count times
its own block size, plus every block's hash and the fixed fields).
"""

from __future__ import annotations

import asyncio
import struct
from typing import TypeVar

import msgspec

from engine.pd.params import KvTransferError

__all__ = [
    "MAX_REQUEST_BYTES",
    "PullAnswer",
    "PullRequest",
    "answer_limit",
    "read_frame",
    "write_frame",
]

_LEN = struct.Struct(">I")
#: a pull names one transfer and at most a few thousand block ids
MAX_REQUEST_BYTES = 1 << 20
T = TypeVar("T")


class PullRequest(msgspec.Struct, kw_only=True):
    """``remote_engine_id``, ``remote_request_id`` and ``remote_block_ids`` as the prefill answer
    gave them: the prefill engine checks all three against its epoch and the lease."""

    engine_id: str
    transfer_id: str
    block_ids: list[int]
    #: leading blocks the decode engine holds already: not sent (the lease ends all the same)
    first: int = 0


class PullAnswer(msgspec.Struct, kw_only=True):
    """The KV bytes of blocks ``[first:]`` in order and the engine hashes of all, or ``error``."""

    error: str | None = None
    fingerprint: str = ""
    block_hashes: list[int] = msgspec.field(default_factory=list)
    blocks: list[bytes] = msgspec.field(default_factory=list)


def answer_limit(num_blocks: int, block_bytes: int, num_hashes: int) -> int:
    """The largest answer a pull of ``num_blocks`` blocks of ``block_bytes`` may get, with the
    hashes of all ``num_hashes`` blocks of the lease (the held ones too: a 190k-token prompt's
    12k hashes are 108 KB, however few blocks are pulled; at most 9 bytes each in msgpack)."""
    return num_blocks * (block_bytes + 32) + num_hashes * 9 + 64 * 1024


async def write_frame(writer: asyncio.StreamWriter, obj: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(obj)
    writer.write(_LEN.pack(len(body)) + body)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, kind: type[T], limit: int) -> T:
    """One frame of ``kind``; :class:`KvTransferError` on a closed connection, an oversized or a
    malformed frame."""
    try:
        (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if size > limit:
            raise KvTransferError(
                f"a frame of {size} bytes, over the {limit} expected", "unreachable"
            )
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise KvTransferError(
            f"the peer closed the connection mid-frame ({len(exc.partial)} bytes read)",
            "unreachable",
        ) from exc
    try:
        return msgspec.msgpack.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise KvTransferError(f"malformed {kind.__name__}: {exc}", "unreachable") from exc
