"""Replica sync's one message shape on the wire: :class:`SyncMessage`, msgpack through msgspec,
one ZMQ frame. A publisher batches the events of its placing loop's turn into one message
(``events``: :mod:`router.placement.remote`'s :class:`Placed`, :class:`FirstToken`,
:class:`Ended`; none for a heartbeat) under its ``origin`` (random per process start) and its next
``seq``. The decoder checks every bound the receiver relies on; ``max_message_bytes`` bounds the
frame before it is read (ZMQ_MAXMSGSIZE)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from router.placement.remote import RemoteEvent

__all__ = ["FLUSH_EVENTS", "MAX_EVENTS", "VERSION", "SyncMessage", "decode", "encode"]

VERSION = 1
#: events per message the receiver accepts
MAX_EVENTS = 1024
#: events after which the publisher sends at once rather than at the end of the loop's turn
FLUSH_EVENTS = 256


class SyncMessage(msgspec.Struct, array_like=True):
    version: int
    origin: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    seq: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    #: the publisher's router block size: its hashes mean nothing under another one
    block_size: int
    events: Annotated[list[RemoteEvent], msgspec.Meta(max_length=MAX_EVENTS)]


encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(SyncMessage).decode


def decode(frame: bytes | memoryview) -> SyncMessage:
    """One frame as a :class:`SyncMessage`; raises :class:`msgspec.DecodeError` and nothing
    else: msgspec before 0.23 reports a string that is not UTF-8 as ``UnicodeDecodeError``, which
    no caller would expect (a 4-byte frame of one such string ended the sync task); 0.23 raises
    ``DecodeError`` itself."""
    try:
        return _decode(frame)
    except UnicodeDecodeError as e:
        raise msgspec.DecodeError(f"a string that is not UTF-8: {e}") from e
