"""The OpenAI proxy: ``POST /v1/completions`` and ``POST /v1/chat/completions`` to the chosen worker.

- The request comes in through the front door (:mod:`router.edge.door`: keys, admission, body,
  pick); a remote pick's prefill leg runs first (:mod:`router.edge.pd_flow`), then the decode
  worker, whose answer is the client's.

- The client's body is forwarded byte for byte (the router never adds ``stream_options``), but
  for a disaggregated request's legs (:mod:`router.edge.legs`); only registered worker URLs are
  ever called.
- Pinned (``x-kvrouter-worker`` with the admin key, :func:`router.edge.door.pinned`): only that
  worker may serve it, so it is never retried on another.
- Retry: a connection failure, a timeout before the response head, or a 502/503/504 moves the
  request to the next best worker — only while nothing was sent to the client. Afterwards an
  upstream failure aborts the client's connection (a truncated stream, never a fake end).
- Streaming (SSE) is passed through chunk by chunk. The client going away cancels the task that
  runs :func:`proxy_request`, which closes the upstream connection, while waiting for the head or
  during the body.
- Accounting: the request counts as in-flight prefill on its worker until the first body byte,
  and as active until the response ends; ``usage.prompt_tokens_details.cached_tokens`` (the final
  usage chunk when streaming, if the client asked for one) is compared with the prediction.

:func:`proxy_request` writes through a :class:`Responder`; :class:`AsgiProxy` is its ASGI form,
the endpoint the app mounts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from router.edge.bodies import read_body
from router.edge.door import Entry, enter, pick_headers, pinned
from router.edge.legs import apply, decode_patch
from router.edge.pd_flow import PrefillAnswer, Sibling, SiblingFailed, prefill_first
from router.edge.usage import UsageScan, cached_tokens_of
from router.errors import (
    BadGateway,
    GatewayTimeout,
    NoHealthyWorker,
    RouterError,
    error_json,
)
from router.fleet.upstream import ConnectError, ReadTimeout, UpstreamError, UpstreamResponse
from router.placement import REMOTE, Choice, Flight, cached_tokens
from router.runtime import Runtime

__all__ = ["AsgiProxy", "Responder", "proxy_request"]

log = logging.getLogger("kvrouter.proxy")

_TRACE_HEADERS = ("traceparent", "tracestate")
_FORWARD_HEADERS = ("authorization", "accept", "x-request-id", *_TRACE_HEADERS)
_SAFE_VALUE = re.compile(r"[\x20-\x7e]{1,256}")
Headers = list[tuple[bytes, bytes]]


class Responder:
    """Where :func:`proxy_request` writes its answer: either one whole response, or a head then
    chunks then the end. ``abort`` cuts the connection (a truncated stream, never a fake end)."""

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        raise NotImplementedError

    async def start(self, status: int, headers: Headers) -> None:
        raise NotImplementedError

    async def chunk(self, data: bytes) -> None:
        raise NotImplementedError

    async def end(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


async def _exchange(
    state: Runtime,
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


async def proxy_request(
    state: Runtime,
    endpoint: str,
    body: bytes,
    header: Callable[[str], str | None],
    out: Responder,
    t0: float,
) -> None:
    """Proxy one request (``endpoint``: ``completions`` or ``chat``) and write the answer to
    ``out``. Raises :class:`RouterError` only before anything was written. Cancelling the task
    (the client went away) closes the upstream exchange and counts ``client_disconnect``."""
    eligible = pinned(state, header)
    entry = await enter(state, endpoint, body, header("authorization"), eligible=eligible)
    try:
        await _serve(state, entry, _forwarded(state, header), out, t0)
    finally:
        entry.release()


def _forwarded(state: Runtime, header: Callable[[str], str | None]) -> list[tuple[str, str]]:
    """The client's headers a worker gets: never the router's own client key, and the router's
    span as the trace parent when tracing."""
    fwd = [("Content-Type", "application/json")]
    keys = state.settings.api_keys
    trace_headers = state.trace_headers
    traced = trace_headers is not None
    for h in _FORWARD_HEADERS:
        if (keys and h == "authorization") or (traced and h in _TRACE_HEADERS):
            continue
        v = header(h)
        if v is not None:
            fwd.append((h, v))
    if trace_headers is not None:
        fwd += trace_headers()
    return fwd


async def _serve(
    state: Runtime, entry: Entry, fwd: list[tuple[str, str]], out: Responder, t0: float
) -> None:
    """Execute the pick: the prefill leg first when it is remote (:mod:`router.edge.pd_flow`),
    then the decode worker, the next best on a failed connection."""
    pick, placer, endpoint = entry.pick, state.placer, entry.endpoint or ""
    d = pick.decision
    params: dict[str, Any] | None = None
    sibling: Sibling | None = None
    explain = state.settings.scoring.explain

    def picked(dc: Choice | None = None) -> Headers:
        return [(k.encode(), v.encode()) for k, v in pick_headers(pick, dc, explain=explain)]

    reserved: Flight | None = None
    if pick.mode == REMOTE:
        if state.settings.pd.protocol == "sglang":
            sibling = Sibling(state, entry, fwd, t0)
        else:
            # the decode worker is taken now, not once the prefill answers: requests placed
            # meanwhile see it loaded instead of herding onto it (docs/architecture.md §10)
            reserved = placer.fly(
                d, pick.decode.index, "proxy", endpoint=endpoint, t0=t0, leg="decode"
            )
            try:
                got = await prefill_first(state, entry, fwd, t0)
            except asyncio.CancelledError:
                reserved.done("client_disconnect")
                raise
            except Exception:
                reserved.done("prefill_failed")
                raise
            if isinstance(got, PrefillAnswer):
                reserved.done("prefill_refused")
                ctype = got.content_type.encode() if got.content_type else b"application/json"
                await out.whole(got.status, [(b"content-type", ctype), *picked()], got.content)
                return
            if got is None:  # fell back: the decode worker prefills, a flight of its own
                reserved.done("prefill_failed")
                reserved = None
            params = got
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    errors: list[str] = []
    attempts = pick.decodes[: 1 + state.settings.proxy.retries]
    k, reloaded = 0, False
    try:
        while k < len(attempts):
            dc = attempts[k]
            ws, remote = dc.worker, pick.mode == REMOTE
            if reserved is not None:  # (the first attempt: the pick's decode worker)
                flight, reserved = reserved, None
            else:
                flight = placer.fly(
                    d, dc.index, "proxy", endpoint=endpoint, t0=t0, leg=_leg(remote)
                )
            headers = fwd
            if ws.config.dp_ranks > 1:
                headers = [*fwd, ("X-Data-Parallel-Rank", str(dc.cand.key[1]))]
            body = entry.body
            if remote and sibling is not None:
                body = sibling.decode_body
            elif remote and params:
                body = apply(entry.body, decode_patch("nixl"), {"kv_transfer_params": params})
            if remote:
                p = pick.prefill
                assert p is not None  # (the predicted hit of a decode leg is the prefill's)
                flight.predicted_tokens = cached_tokens(p.cand, d.tokens, d.block_size)
            t1 = time.perf_counter()
            try:
                sent = _exchange(state, ws.url, path, headers, body, stream=entry.stream)
                resp, content = await (sibling.race(sent) if sibling and remote else sent)
            except SiblingFailed as e:
                flight.done("prefill_failed")
                sibling = None
                if e.answer is not None:
                    a = e.answer
                    ctype = a.content_type.encode() or b"application/json"
                    await out.whole(a.status, [(b"content-type", ctype), *picked(dc)], a.content)
                    return
                pick.fall_back(e.cause)
                state.metrics.pd.fell_back(e.cause)
                continue  # (the same decode worker, prefilling itself)
            except asyncio.CancelledError:
                flight.done("client_disconnect")
                raise
            except ConnectError as e:  # nothing reached the worker: the next one may take it
                flight.done("upstream_error")
                reason = type(e).__name__
                errors.append(f"{ws.id}: {reason}: {e}")
                state.registry.mark_failure(ws.id, f"proxy: {e}", now=True)
                state.metrics.retries.labels(ws.id, reason).inc()
                k += 1
                continue
            except UpstreamError as e:
                # the worker may have the request: never send a second copy anywhere
                flight.done("upstream_error")
                state.registry.mark_failure(ws.id, f"proxy: {e}", now=False)
                if isinstance(e, ReadTimeout):
                    raise GatewayTimeout(f"worker {ws.id}: {type(e).__name__}: {e}") from e
                raise BadGateway(f"worker {ws.id} failed: {type(e).__name__}: {e}") from e
            if remote:
                state.metrics.pd.leg("decode", time.perf_counter() - t1)
                if resp.status_code >= 500 and not reloaded:
                    # the decode worker refused the transfer (vLLM: KV load failed, policy
                    # fail): it answered, so it holds no copy; once more, prefilling itself
                    flight.done(str(resp.status_code))
                    if sibling is not None:
                        sibling.cancel()
                        sibling = None
                    reloaded = True
                    pick.fall_back("decode_kv_load")
                    state.metrics.pd.fell_back("decode_kv_load")
                    continue
            out_headers: Headers = [
                (b"content-type", _content_type(resp.header("content-type"), content)),
                *picked(dc),
            ]
            if content is None:
                await _stream(resp, flight, out, out_headers)
                return
            flight.first_byte()
            if resp.status_code == 200:
                flight.cached = cached_tokens_of(content)
            flight.done(str(resp.status_code))
            await out.whole(resp.status_code, out_headers, content)
            return
        raise NoHealthyWorker(f"every worker tried failed ({'; '.join(errors)})")
    finally:
        if sibling is not None:
            sibling.cancel()


def _leg(remote: bool) -> str:
    return "decode" if remote else ""


def _content_type(upstream: str | None, content: bytes | None) -> bytes:
    """The worker's content type when it is a plain token (no CR, LF or other control bytes can
    reach the client's head), else what the endpoint answers."""
    if upstream is not None and _SAFE_VALUE.fullmatch(upstream):
        return upstream.encode("ascii")
    return b"text/event-stream" if content is None else b"application/json"


async def _stream(resp: UpstreamResponse, flight: Flight, out: Responder, headers: Headers) -> None:
    status = str(resp.status_code)
    usage = UsageScan()
    try:
        await out.start(resp.status_code, headers)
        async for chunk in resp.iter_chunks():
            if not chunk:
                continue
            flight.first_byte()
            usage.feed(chunk)
            await out.chunk(chunk)
        flight.first_byte()
        await out.end()
    except asyncio.CancelledError:
        status = "client_disconnect"
        raise
    except (UpstreamError, OSError) as e:
        # the head was sent: no retry, and no end of body: the client sees a truncated stream
        log.warning("upstream %s failed mid-stream: %r", flight.worker, e)
        status = "upstream_error"
        out.abort()
    finally:
        await resp.aclose()  # never awaits: safe while cancelled
        if usage.cached is not None:
            flight.cached = usage.cached
        flight.done(status)


# ------------------------------------------------------------------------------ ASGI form


class _AsgiOut(Responder):
    def __init__(self, send: Send) -> None:
        self.send = send
        self.aborted = False

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: Headers) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    def abort(self) -> None:
        self.aborted = True  # returning without ending the body makes the server cut it


class AsgiProxy:
    """The proxy as a plain ASGI endpoint (``endpoint``: ``completions`` or ``chat``), which
    :class:`router.edge.dispatch.RouterApp` calls: the body is read, :func:`proxy_request` runs in a task,
    and a client disconnect cancels it. ``app_state`` is the app's ``state`` (``kv`` once
    started)."""

    def __init__(self, endpoint: str, app_state: Any) -> None:
        self.endpoint = endpoint
        self.app_state = app_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: Runtime = self.app_state.kv
        t0 = time.perf_counter()
        out = _AsgiOut(send)
        request = Request(scope, receive)
        try:
            s = state.settings
            body = await read_body(request, s.proxy.max_body_bytes, s.server.body_timeout_s)
            task = asyncio.ensure_future(
                proxy_request(state, self.endpoint, body, request.headers.get, out, t0)
            )
            watcher = asyncio.ensure_future(_until_disconnect(receive))
            try:
                await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
            finally:
                watcher.cancel()
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if not task.cancelled():
                task.result()
        except ClientDisconnect:
            return  # gone while sending the body: nobody to answer
        except RouterError as e:
            state.metrics.rejected.labels(str(e.status)).inc()
            await out.whole(
                e.status,
                [(b"content-type", b"application/json")],
                error_json(e.message, e.type, e.param),
            )


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
