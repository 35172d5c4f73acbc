"""OpenAI-compatible request bodies (msgspec, one decoder each) and response builders.

Unknown fields are ignored, as the OpenAI API and vLLM do; wrong types are a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from engine.pd.params import KVTransferParams

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "ErrorBody",
    "StopChecker",
    "StreamOptions",
    "TokenizeRequest",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "decode_body",
    "error_body",
    "usage",
]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False
    #: vLLM's NIXL exchange (engine.pd): a prefill leg or a decode leg
    kv_transfer_params: KVTransferParams | None = None


class CompletionRequest(_Common, kw_only=True):
    #: a string, token ids, or a one-element list of either (checked by the server)
    prompt: str | list[Any]


class ChatRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t) for t in (CompletionRequest, ChatRequest, TokenizeRequest)
}


def decode_body(body: bytes, kind: type[Any]) -> Any:
    """Decode a request body; raises ``msgspec.DecodeError``/``ValidationError`` on bad input."""
    return _DECODERS[kind].decode(body)


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str


class ErrorBody(msgspec.Struct):
    error: _ErrorDetail


def error_body(message: str, type_: str) -> bytes:
    """The router's error shape: ``{"error": {"message", "type"}}``."""
    return msgspec.json.encode(ErrorBody(_ErrorDetail(message, type_)))


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": use,
    }


def completion_chunk(
    rid: str, model: str, text: str | None, finish: str | None, use: dict[str, Any] | None = None
) -> dict[str, Any]:
    choices = (
        []
        if text is None
        else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    )
    out: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out


def chat_response(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": use,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any] | None,
    finish: str | None,
    use: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    )
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out


class StopChecker:
    """Accumulates streamed text and cuts it at the first stop string. While streaming it holds
    back the last ``max(len(stop)) - 1`` characters, which could still begin a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add generated text; return what can be sent now."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        end = len(self.text) if self.stopped else len(self.text) - self._hold
        if end <= self._sent:
            return ""
        out, self._sent = self.text[self._sent : end], end
        return out

    def flush(self) -> str:
        out, self._sent = self.text[self._sent :], len(self.text)
        return out
