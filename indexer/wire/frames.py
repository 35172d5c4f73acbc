"""The 8-byte big-endian sequence frame shared by live messages and replay."""

from __future__ import annotations

from .errors import FrameError

__all__ = ["END_SEQ", "SEQ_BYTES", "pack_seq", "unpack_seq"]

SEQ_BYTES = 8
#: The replay end marker's sequence number: ``ff`` x 8 read as a signed integer.
END_SEQ = -1

_U64 = (1 << 64) - 1


def pack_seq(seq: int) -> bytes:
    """``seq`` as 8 big-endian bytes; ``-1`` (the replay end marker) becomes ``ff`` x 8."""
    if not -1 <= seq <= _U64:
        raise ValueError(f"sequence number {seq} does not fit in 8 bytes")
    return (seq & _U64).to_bytes(SEQ_BYTES, "big")


def unpack_seq(frame: bytes, *, signed: bool = False) -> int:
    """Read a sequence frame; ``signed`` for replay replies, whose end marker is ``-1``."""
    if len(frame) != SEQ_BYTES:
        raise FrameError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=signed)
