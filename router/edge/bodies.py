"""HTTP boundary shapes: request bodies (msgspec, one reusable decoder per shape), the ``/route``
answer, and reading a body under the configured size limit.

Invalid JSON → 400; valid JSON of the wrong shape → 422 naming the field (``token_ids[3]: expected
`int`, got `str```); a body over ``proxy.max_body_bytes`` → 413, enforced while reading (a client
may lie in, or omit, ``Content-Length``). What msgspec leaves unchecked (bad UTF-8 in a skipped
field, nesting past :data:`router.edge.bodycheck.MAX_DEPTH`, a field given twice) → 400, by
:mod:`router.edge.bodycheck`. Every decoder here raises only :class:`router.errors.RouterError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from indexer.hashing import chain_hashes
from indexer.hashing import chain_hashes_json as _hash_json
from router.edge.bodycheck import check_shape, check_utf8, too_deep
from router.edge.legs import PdOut
from router.errors import (
    BadRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnprocessableEntity,
    error_json,
)
from router.settings import describe_validation_error

try:  # the /route body scanner (router/_native.c); without it the whole body is decoded
    from router._native import json_array_span as _array_span
except ImportError:  # pragma: no cover - only where the extension could not be built
    _array_span = None

__all__ = [
    "CandidateOut",
    "ChatBody",
    "CompletionBody",
    "JsonTokens",
    "RouteOut",
    "RouteRequest",
    "WorkerIn",
    "decode",
    "decode_route",
    "encode",
    "error_response",
    "read_body",
]

T = TypeVar("T")


class RouteRequest(msgspec.Struct):
    model: str | None = None
    # kept as JSON text: see JsonTokens (empty when absent)
    token_ids: msgspec.Raw = msgspec.Raw(b"")
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    lora_name: str | None = None
    #: vLLM's per-request cache isolation: salted blocks match only requests with the same salt
    cache_salt: str | None = None
    #: the answer's bound in tokens, when known: a short answer is the one a prefill beside it
    #: stalls most (pd.stall_reference_tokens)
    max_tokens: int | None = None
    account: bool = False


#: a field only the router sets (the API description says so)
_Refused = Annotated[
    Any, msgspec.Meta(description="set by the router only: a request with it gets 400")
]


class _OpenAIBody(msgspec.Struct):
    """What both OpenAI bodies carry that the router reads: ``n`` (several answers: one leg on
    the decode worker), the answer's bound (a prefill beside a short answer stalls it most)
    and the fields that steer a KV transfer, which only the router may set
    (:data:`router.edge.legs.STEERING`: a client sending one gets 400)."""

    n: int | None = None
    #: read as given (any JSON): the worker judges it, the router only uses an integer
    max_tokens: Any = None
    max_completion_tokens: Any = None
    kv_transfer_params: _Refused = None
    bootstrap_host: _Refused = None
    bootstrap_port: _Refused = None
    bootstrap_room: _Refused = None

    def output_bound(self) -> int | None:
        """The answer's bound in tokens (vLLM's order: ``max_completion_tokens``, then
        ``max_tokens``); None when the body gives no integer one."""
        for v in (self.max_completion_tokens, self.max_tokens):
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None


class CompletionBody(_OpenAIBody):
    """The fields of an OpenAI completions request the router reads; the body is forwarded as is."""

    model: str | None = None
    # str | list[str] | list[int] | list[list[int]]: msgspec unions allow one array type, so the
    # shape is checked by ``completion_tokens_source``
    prompt: Any = None
    stream: bool = False
    lora_name: str | None = None
    cache_salt: str | None = None


class ChatBody(_OpenAIBody):
    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool = False
    lora_name: str | None = None
    cache_salt: str | None = None


class WorkerIn(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /workers`` body (same names as a ``workers:`` entry of the YAML config)."""

    id: str
    url: str
    #: omitted: read from the worker's GET /kv_event_sources; "none": it publishes no events
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    dp_ranks: int = 1
    pool: str | None = None
    model: str = ""
    #: prefill, decode or both (the default); SGLang PD: the prefill worker's bootstrap port
    role: str = "both"
    bootstrap_port: int | None = None
    #: GPU KV blocks per rank when its /metrics does not say
    kv_blocks: int | None = None


class CandidateOut(msgspec.Struct, gc=False):
    worker_id: str
    dp_rank: int
    healthy: bool
    matched_blocks: int
    matched_by_tier: dict[str, int]
    predicted_blocks: int
    active_blocks: int
    inflight_prefill_blocks: float
    shared_active_blocks: int
    shared_prefill_blocks: int
    credited_blocks: float
    cost: float
    #: where its match came from: "events" (its KV events) or "approximate" (what was sent)
    source: str


class RouteOut(msgspec.Struct, omit_defaults=True, gc=False):
    worker_id: str
    dp_rank: int
    url: str
    block_size: int
    request_blocks: int
    #: blocks of the request's leading run the chosen worker holds, on any tier
    matched_blocks: int
    candidates: list[CandidateOut]
    #: deprecated name of ``matched_blocks`` (same value), kept for old clients: the README's
    #: "Changes" lists it
    cached_blocks: int = 0
    #: the prompt's length in the router's tokens (what its blocks are of; a worker whose
    #: tokenizer differs counts another length: ``kvrouter check`` compares)
    prompt_tokens: int = 0
    route_id: str | None = None
    #: a disaggregated fleet's decision and legs
    pd: PdOut | None = None


_decoders: dict[type, tuple[msgspec.json.Decoder[Any], frozenset[str]]] = {}
# token ids are non-negative and fit the engines' int64: anything else is the client's error
MAX_TOKEN_ID = (1 << 63) - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
_decode_token_list = msgspec.json.Decoder(list[TokenId]).decode


class JsonTokens:
    """``token_ids`` still as JSON text. Hashed by ``indexer.hashing.chain_hashes_json`` straight
    from the text (one Python int per token costs ~40 ns, i.e. ~160 µs at 4,096 tokens on the
    reference machine); decoded to a list only when needed or when the C path declines."""

    __slots__ = ("_list", "count", "raw")

    def __init__(self, raw: msgspec.Raw | bytes) -> None:
        self.raw = raw
        self.count = -1
        self._list: list[int] | None = None

    def hashes(self, block_size: int, seed: int) -> list[int]:
        if self._list is None and _hash_json is not None:  # (declines ids out of int64 range)
            r = _hash_json(self.raw, block_size, seed)
            if r is not None and r[0]:  # no full block: decoding is as cheap, and needed anyway
                self.count = r[1]
                return r[0]
        return chain_hashes(self.tokens(), block_size, seed)

    def tokens(self) -> list[int]:
        if self._list is None:
            try:
                self._list = _decode_token_list(self.raw)
            except msgspec.ValidationError as e:
                key, problem = describe_validation_error(e)
                at = "" if key == "<top level>" else key
                raise UnprocessableEntity(f"token_ids{at}: {problem}") from e
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
                # (cut out of the body by decode_route: not checked before)
                raise BadRequest(f"request body is not valid JSON: token_ids: {e}") from e
            self.count = len(self._list)
        return self._list


encode = msgspec.json.Encoder().encode


def error_response(
    status: int,
    message: str,
    type_: str,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> Response:
    """An error answer: :func:`router.errors.error_json` (the one error body) as a response."""
    body = error_json(message, type_, param)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


_route_decoder = msgspec.json.Decoder(RouteRequest)
_route_fields = frozenset(RouteRequest.__struct_fields__)


def decode_route(body: bytes) -> tuple[RouteRequest, JsonTokens | None]:
    """A ``/route`` body and its ``token_ids`` (None when not given), still as JSON text.

    A flat token array is cut out of the body first and only the rest is decoded, so the ~25 KB
    of a 4,096-token request are walked once, by the hash. Anything unusual (no C extension,
    nested values, the key twice, a body the cut leaves invalid) takes the whole-body decode,
    which also words the error. The array itself is checked when its tokens are read (it holds
    no string, array or object: the C scanner cut it out only then)."""
    span = _array_span(body, b"token_ids") if _array_span is not None else None
    if span is not None:
        start, end = span
        rest = body[:start] + b"null" + body[end:]
        try:
            req = _route_decoder.decode(rest)
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
            pass  # the whole-body decode words it
        else:
            if memoryview(req.token_ids) == b"null":
                check_utf8(rest)
                check_shape(rest, _route_fields)
                return req, JsonTokens(body[start:end])
    req = decode(body, RouteRequest)
    raw = req.token_ids
    if len(raw) and memoryview(raw)[:4] != b"null":
        return req, JsonTokens(raw)
    return req, None


def decode(body: bytes, typ: type[T]) -> T:
    """``body`` as ``typ`` (a Struct), checked (:mod:`router.edge.bodycheck`): raises
    :class:`BadRequest` or :class:`UnprocessableEntity`, nothing else."""
    known = _decoders.get(typ)
    if known is None:
        fields = frozenset(getattr(typ, "__struct_fields__", ()))
        known = _decoders[typ] = (msgspec.json.Decoder(typ), fields)
    dec, fields = known
    check_utf8(body)
    try:
        obj = dec.decode(body)
    except msgspec.ValidationError as e:
        key, problem = describe_validation_error(e)
        if key == "<top level>":
            raise UnprocessableEntity(f"request body: {problem}") from e
        raise UnprocessableEntity(f"{key}: {problem}") from e
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise too_deep() from e
    check_shape(body, fields)
    return obj


if sys.version_info >= (3, 11):
    _timeout = asyncio.timeout  # a timer on the running task: no task of its own per body
else:  # pragma: no cover - Python 3.10

    @contextlib.asynccontextmanager
    async def _timeout(seconds: float) -> AsyncIterator[None]:
        task = asyncio.current_task()
        assert task is not None
        handle = asyncio.get_running_loop().call_later(seconds, task.cancel)
        try:
            yield
        except asyncio.CancelledError as e:
            raise asyncio.TimeoutError() from e
        finally:
            handle.cancel()


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The request body, at most ``limit`` bytes, all of it within ``timeout_s`` (a client that
    stops half way gets 408 instead of holding its connection for ever)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"request body of {length} bytes is over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    try:
        async with _timeout(timeout_s):
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
                if chunk:
                    chunks.append(chunk)
                if not msg.get("more_body", False):
                    break
    except asyncio.TimeoutError as e:
        raise RequestTimeout(f"request body not received within {timeout_s} s") from e
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


def completion_tokens_source(prompt: Any) -> str | list[int] | None:
    """The prompt to route on: the string or token list, or the first of a batch. The whole
    prompt is checked: a string, a list of strings, a token list or a list of token lists, each
    token id an ``int`` from 0 to 2**63-1 (as ``token_ids`` of ``/route``)."""
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            return None
        first = prompt[0]
        if isinstance(first, str):
            for i, p in enumerate(prompt):
                if not isinstance(p, str):
                    raise UnprocessableEntity(f"prompt[{i}]: expected a string, as prompt[0]")
            return first
        if isinstance(first, list):
            for i, p in enumerate(prompt):
                if not isinstance(p, list):
                    raise UnprocessableEntity(f"prompt[{i}]: expected a token list, as prompt[0]")
                _check_token_list(p, f"prompt[{i}]")
            return first or None
        _check_token_list(prompt, "prompt")
        return prompt
    raise UnprocessableEntity(
        "prompt: expected a string, a list of strings, a token list or a list of token lists"
    )


def _check_token_list(tokens: list[Any], where: str) -> None:
    if all(type(t) is int for t in tokens) and (
        not tokens or (min(tokens) >= 0 and max(tokens) <= MAX_TOKEN_ID)
    ):
        return
    for i, t in enumerate(tokens):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise UnprocessableEntity(
                f"{where}[{i}]: expected a token id, an `int` from 0 to 2**63-1"
            )


def check_messages(messages: list[dict[str, Any]]) -> None:
    """The parts of chat messages the router reads: ``role`` a string; ``content`` a string or a
    list of parts, each a string or an object, a ``text`` part's ``text`` a string."""
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise UnprocessableEntity(f"messages[{i}].role: expected `str`")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise UnprocessableEntity(f"messages[{i}].content: expected a string or a list")
        for j, part in enumerate(content):
            if isinstance(part, str):
                continue
            if not isinstance(part, dict):
                raise UnprocessableEntity(
                    f"messages[{i}].content[{j}]: expected a string or an object"
                )
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise UnprocessableEntity(f"messages[{i}].content[{j}].text: expected `str`")
