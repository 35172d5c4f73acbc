"""The KV event wire contract: ZMQ frames and msgpack payloads of vLLM and SGLang publishers.

Owns decoding (every publisher release in ``tests/fixtures/wire``, to the normalized events of
:mod:`indexer.events`), the vLLM 0.33.0-compatible encoder the bundled engine publishes with, the
replay request/reply frames, and the typed errors for anything malformed. Pure and synchronous:
sockets live in :mod:`indexer.subscriber`.
"""

from __future__ import annotations

from .decode import decode_message, decode_payload
from .encode import encode_message, encode_payload
from .errors import FrameError, PayloadError, SchemaError, WireError
from .frames import END_SEQ
from .replay import (
    ReplayReply,
    decode_replay_reply,
    decode_replay_request,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_request,
)

__all__ = [
    "END_SEQ",
    "FrameError",
    "PayloadError",
    "ReplayReply",
    "SchemaError",
    "WireError",
    "decode_message",
    "decode_payload",
    "decode_replay_reply",
    "decode_replay_request",
    "encode_message",
    "encode_payload",
    "encode_replay_end",
    "encode_replay_reply",
    "encode_replay_request",
]
