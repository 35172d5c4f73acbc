"""The OpenAI proxy: ``POST /v1/completions`` and ``POST /v1/chat/completions`` to the chosen worker.

- The client's body is forwarded byte for byte (the router never adds ``stream_options``); only
  registered worker URLs are ever called.
- Retry: a connection failure, a timeout before the response head, or a 502/503/504 moves the
  request to the next best worker — only while nothing was sent to the client. Afterwards an
  upstream failure aborts the client's connection (a truncated stream, never a fake end).
- Streaming (SSE) is passed through chunk by chunk. The client going away cancels the upstream
  request (its connection is closed), while waiting for the head or during the body.
- Accounting: the request counts as in-flight prefill on its worker until the first body byte,
  and as active until the response ends; ``usage.prompt_tokens_details.cached_tokens`` (the final
  usage chunk when streaming, if the client asked for one) is compared with the prediction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.api import (
    ChatBody,
    CompletionBody,
    check_messages,
    completion_tokens_source,
    decode,
    read_body,
)
from router.errors import BadRequest, NoHealthyWorker, TooManyRequests
from router.service import Decision, RouterState
from router.upstream import ConnectError, UpstreamError, UpstreamResponse

__all__ = ["ClientGone", "ProxyStream", "proxy_openai", "race_disconnect"]

log = logging.getLogger("kvrouter.proxy")
T = TypeVar("T")

_FORWARD_HEADERS = ("Authorization", "Accept", "X-Request-Id", "Traceparent", "Tracestate")
_RETRY_STATUSES = frozenset((502, 503, 504))


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` unless the client disconnects first (then cancel it, raise ClientGone)."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


class _Usage(msgspec.Struct):
    class _Details(msgspec.Struct):
        cached_tokens: int | None = None

    prompt_tokens_details: _Details | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_decode_usage = msgspec.json.Decoder(_WithUsage).decode


def cached_tokens_of(payload: bytes) -> int | None:
    try:
        u = _decode_usage(payload).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if u is None or u.prompt_tokens_details is None:
        return None
    return u.prompt_tokens_details.cached_tokens


class _Flight:
    """One attempt on one worker: its accounting ticket and metrics, closed exactly once."""

    __slots__ = (
        "cached",
        "cand",
        "endpoint",
        "inflight",
        "predicted_tokens",
        "state",
        "t0",
        "ticket",
        "usage_tail",
        "worker",
    )

    def __init__(self, state: RouterState, d: Decision, i: int, endpoint: str, t0: float) -> None:
        self.state = state
        self.cand = d.candidates[i]
        self.worker = self.cand.key[0]
        self.endpoint = endpoint
        self.t0 = t0
        self.ticket = state.commit(d, i, kind="proxy")
        # engines (vLLM, the bundled one) always compute at least the last prompt token, so a
        # prompt of exactly k blocks reuses at most k - 1 of them
        bs = d.block_size
        self.predicted_tokens = min(self.cand.matched_blocks, max(0, d.tokens - 1) // bs) * bs
        self.usage_tail = b""
        self.cached: int | None = None
        m = state.metrics
        self.inflight = m.child(m.inflight, self.worker)
        self.inflight.inc()

    def first_byte(self) -> None:
        if self.ticket.state == 0:
            self.state.load.first_token(self.ticket)
            m = self.state.metrics
            m.child(m.ttfb, self.worker).observe(time.perf_counter() - self.t0)

    def scan(self, chunk: bytes) -> None:
        """Find the usage chunk of an SSE stream (lines may straddle network chunks)."""
        if not self.usage_tail and b"cached_tokens" not in chunk:
            if b"\n" not in chunk[-1:]:
                self.usage_tail = chunk[chunk.rfind(b"\n") + 1 :][-4096:]
            return
        buf = self.usage_tail + chunk
        lines = buf.split(b"\n")
        self.usage_tail = lines.pop()[-65536:]
        for line in lines:
            if line.startswith(b"data:") and b"cached_tokens" in line:
                v = cached_tokens_of(line[5:].strip())
                if v is not None:
                    self.cached = v

    def done(self, status: str) -> None:
        st = self.state
        if self.ticket.state == 2:
            return
        st.load.finish(self.ticket)
        self.inflight.dec()
        st.metrics.child(st.metrics.proxied, self.worker, self.endpoint, status).inc()
        if self.cached is not None:
            st.metrics.observe_cached(self.worker, self.predicted_tokens, self.cached)


class ProxyStream(Response):
    """Streams an upstream response; a client disconnect cancels the pump and closes upstream."""

    def __init__(
        self, upstream: UpstreamResponse, flight: _Flight, headers: dict[str, str]
    ) -> None:
        self.upstream = upstream
        self.flight = flight
        self.status_code = upstream.status_code
        self.background = None
        self.media_type = upstream.header("content-type", "text/event-stream")
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = str(self.status_code)
        try:
            async with anyio.create_task_group() as tg:

                async def listen() -> None:
                    nonlocal status
                    await _until_disconnect(receive)
                    status = "client_disconnect"
                    tg.cancel_scope.cancel()

                async def pump() -> None:
                    nonlocal status
                    try:
                        await self._pump(send)
                    except (UpstreamError, OSError) as e:
                        # the head was sent: no retry; return without ending the body so the
                        # server aborts the connection and the client sees a truncated stream
                        log.warning("upstream %s failed mid-stream: %r", self.flight.worker, e)
                        status = "upstream_error"
                    tg.cancel_scope.cancel()

                tg.start_soon(listen)
                tg.start_soon(pump)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
                self.flight.done(status)
                self.flight.state.inflight -= 1

    async def _pump(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        flight = self.flight
        async for chunk in self.upstream.iter_chunks():
            if not chunk:
                continue
            flight.first_byte()
            flight.scan(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        flight.first_byte()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _tokens(state: RouterState, endpoint: str, body: bytes) -> tuple[Any, list[int], bool]:
    if endpoint == "completions":
        req: Any = decode(body, CompletionBody)
        src = completion_tokens_source(req.prompt)
        if src is None:
            raise BadRequest("prompt is required")
        if isinstance(src, str):
            return req, await state.tokenizer.encode(src, req.model), req.stream
        return req, src, req.stream
    req = decode(body, ChatBody)
    if not req.messages:
        raise BadRequest("messages is required")
    check_messages(req.messages)
    return req, await state.tokenizer.encode_chat(req.messages, req.model), req.stream


async def _exchange(
    state: RouterState,
    url: str,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    stream: bool,
) -> tuple[UpstreamResponse, bytes | None]:
    """Send upstream; read the whole body too unless streaming (then the caller streams it)."""
    resp = await state.upstream.request(url, "POST", path, headers, body)
    if stream and resp.status_code == 200:
        return resp, None
    try:
        content = await resp.read()
    finally:
        await resp.aclose()
    return resp, content


async def proxy_openai(state: RouterState, request: Request, endpoint: str) -> Response:
    """``endpoint``: ``completions`` or ``chat`` (→ ``/v1/chat/completions`` upstream)."""
    s = state.settings.proxy
    if state.inflight >= s.max_inflight:
        raise TooManyRequests(f"over max_inflight ({s.max_inflight} requests in flight)")
    t0 = time.perf_counter()
    body = await read_body(request, s.max_body_bytes)
    req, tokens, stream = await _tokens(state, endpoint, body)
    d = state.place(tokens, req.model, req.lora_name)
    if not d.order:
        raise NoHealthyWorker("no healthy worker for this request")
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    fwd = [("Content-Type", "application/json")]
    for h in _FORWARD_HEADERS:
        v = request.headers.get(h)
        if v is not None:
            fwd.append((h, v))
    state.inflight += 1
    handed_off = False
    errors: list[str] = []
    attempts = d.order[: 1 + s.retries]
    try:
        for n, i in enumerate(attempts):
            ws = d.states[i]
            cand = d.candidates[i]
            headers = fwd
            if ws.config.dp_ranks > 1:
                headers = [*fwd, ("X-Data-Parallel-Rank", str(cand.key[1]))]
            flight = _Flight(state, d, i, endpoint, t0)
            try:
                resp, content = await race_disconnect(
                    request, _exchange(state, ws.url, path, headers, body, stream=stream)
                )
            except ClientGone:
                flight.done("client_disconnect")
                return Response(status_code=499)
            except UpstreamError as e:
                flight.done("upstream_error")
                reason = type(e).__name__
                errors.append(f"{ws.id}: {reason}: {e}")
                state.registry.mark_failure(ws.id, f"proxy: {e}", now=isinstance(e, ConnectError))
                state.metrics.retries.labels(ws.id, reason).inc()
                continue
            out_headers = {
                "x-kvrouter-worker": ws.id,
                "x-kvrouter-cached-blocks": str(cand.matched_blocks),
            }
            if ws.config.dp_ranks > 1:
                out_headers["x-kvrouter-dp-rank"] = str(cand.key[1])
            if resp.status_code in _RETRY_STATUSES and n + 1 < len(attempts):
                flight.done(str(resp.status_code))
                errors.append(f"{ws.id}: HTTP {resp.status_code}")
                state.metrics.retries.labels(ws.id, str(resp.status_code)).inc()
                continue
            if content is None:
                handed_off = True
                return ProxyStream(resp, flight, out_headers)
            flight.first_byte()
            if resp.status_code == 200:
                flight.cached = cached_tokens_of(content)
            flight.done(str(resp.status_code))
            return Response(
                content,
                status_code=resp.status_code,
                headers=out_headers,
                media_type=resp.header("content-type", "application/json"),
            )
        raise NoHealthyWorker(f"every worker tried failed ({'; '.join(errors)})")
    finally:
        if not handed_off:
            state.inflight -= 1
