"""Replay frames: a DEALER asks a publisher's ROUTER socket for buffered messages from a seq on.

Request ``[b"", start_seq]`` (the ROUTER sees ``[identity, b"", start_seq]``). Each reply is
``[b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang >= 0.5.22) or ``[b"", seq, payload]`` (older
vLLM), and the last one is the end marker: seq -1 (``ff`` x 8) with an empty payload. The payloads
are the same bytes as the live messages with those sequence numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .errors import FrameError
from .frames import END_SEQ, pack_seq, unpack_seq

__all__ = [
    "ReplayReply",
    "decode_replay_reply",
    "decode_replay_request",
    "encode_replay_end",
    "encode_replay_reply",
    "encode_replay_request",
]


class ReplayReply(msgspec.Struct, frozen=True):
    """One reply frame set; ``topic`` is None in the older layout without a topic frame."""

    seq: int
    payload: bytes
    topic: bytes | None = None

    @property
    def is_end(self) -> bool:
        return self.seq == END_SEQ


def encode_replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered message from ``start_seq`` on."""
    if start_seq < 0:
        raise ValueError(f"replay start seq must be >= 0, got {start_seq}")
    return [b"", pack_seq(start_seq)]


def decode_replay_request(frames: Sequence[bytes]) -> int:
    """The start seq of a request as a ROUTER receives it: ``[identity, b"", seq]``.

    ``[identity, seq]`` (a REQ-less client that sent no delimiter) is accepted too.
    """
    if len(frames) == 3:
        if len(frames[1]) != 0:
            raise FrameError(
                f"replay request delimiter frame must be empty, got {len(frames[1])} bytes"
            )
    elif len(frames) != 2:
        raise FrameError(
            f"replay request must have 3 frames [identity, b'', seq], got {len(frames)}"
        )
    return unpack_seq(frames[-1])


def encode_replay_reply(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One reply in the vLLM >= 0.26 layout ``[b"", topic, seq, payload]``.

    A ROUTER socket sends it behind the requester's identity frame.
    """
    return [b"", topic, pack_seq(seq), payload]


def encode_replay_end(topic: bytes = b"") -> list[bytes]:
    """The end marker: seq -1 and an empty payload (vLLM sends an empty topic with it)."""
    return [b"", topic, pack_seq(END_SEQ), b""]


def decode_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """A reply as a DEALER receives it: ``[b"", seq, payload]`` or ``[b"", topic, seq, payload]``."""
    n = len(frames)
    if n not in (3, 4):
        raise FrameError(
            f"replay reply must have 3 frames [b'', seq, payload] or 4 [b'', topic, seq, payload], "
            f"got {n}"
        )
    if len(frames[0]) != 0:
        raise FrameError(f"replay reply delimiter frame must be empty, got {len(frames[0])} bytes")
    seq = unpack_seq(frames[-2], signed=True)
    topic = bytes(frames[1]) if n == 4 else None
    return ReplayReply(seq=seq, payload=bytes(frames[-1]), topic=topic)
