"""The wire error hierarchy: one base, one subclass per layer a message can be broken at.

Callers (the subscriber) catch :class:`WireError`, count the message as malformed and drop it; the
subclass says which layer was wrong, and the message names what was wrong.
"""

from __future__ import annotations

__all__ = ["FrameError", "PayloadError", "SchemaError", "WireError"]


class WireError(ValueError):
    """A ZMQ message that is not a KV event message this decoder understands."""


class FrameError(WireError):
    """Wrong number of frames, or a sequence frame that is not 8 bytes."""


class PayloadError(WireError):
    """A payload that is not one valid msgpack value (truncated, reserved byte, trailing bytes,
    invalid UTF-8, a declared length the data does not hold)."""


class SchemaError(WireError):
    """Well-formed msgpack of the wrong shape: wrong types, missing fields, bad values."""
