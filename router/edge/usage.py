"""Reading what a worker's OpenAI answer says it reused: ``usage.prompt_tokens_details.
cached_tokens`` of a whole JSON answer (:func:`cached_tokens_of`) or of the usage chunk of an SSE
stream (:class:`UsageScan`, fed chunk by chunk). The doors (proxy, endpoint picker) set a
flight's ``cached`` from it; the placement core only compares it with its prediction."""

from __future__ import annotations

import msgspec

__all__ = ["UsageScan", "cached_tokens_of"]


class _Usage(msgspec.Struct):
    class _Details(msgspec.Struct):
        cached_tokens: int | None = None

    prompt_tokens_details: _Details | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_decode_usage = msgspec.json.Decoder(_WithUsage).decode


def cached_tokens_of(payload: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI answer (or SSE chunk), if any."""
    try:
        u = _decode_usage(payload).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if u is None or u.prompt_tokens_details is None:
        return None
    return u.prompt_tokens_details.cached_tokens


class UsageScan:
    """The usage chunk of an SSE stream, found as chunks pass (lines may straddle network
    chunks; a partial line is kept, at most 64 KiB). ``cached``: the last value seen."""

    __slots__ = ("cached", "tail")

    def __init__(self) -> None:
        self.tail = b""
        self.cached: int | None = None

    def feed(self, chunk: bytes) -> None:
        if not self.tail and b"cached_tokens" not in chunk:
            if b"\n" not in chunk[-1:]:
                self.tail = chunk[chunk.rfind(b"\n") + 1 :][-4096:]
            return
        buf = self.tail + chunk
        lines = buf.split(b"\n")
        self.tail = lines.pop()[-65536:]
        for line in lines:
            if line.startswith(b"data:") and b"cached_tokens" in line:
                v = cached_tokens_of(line[5:].strip())
                if v is not None:
                    self.cached = v
