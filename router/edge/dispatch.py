"""The ASGI app the router's server runs: the hot endpoints as plain ASGI, the rest through FastAPI.

``POST /route``, ``/v1/completions`` and ``/v1/chat/completions`` carry a fleet's traffic. Through
FastAPI each request also passed Starlette's error middleware, FastAPI's body-limit wrapper, its
native-telemetry check (FastAPI >= 0.142) and its router, and every SSE chunk of a proxied stream
went through each of their ``send`` wrappers. :class:`RouterApp` takes those three paths by exact
path before FastAPI; the access log and, when configured, the tracing middleware wrap every
request alike. Everything else (admin, ops, docs, unknown paths) is FastAPI's, with its routing and
exception handlers. What this saves is measured in ``benchmarks/bench_vs_dynamo.py`` (docs/
architecture.md §"The HTTP edge").

What FastAPI's error middleware gave the hot paths is :func:`_guarded`: an unexpected exception is
logged and answered 500 in OpenAI's error shape while nothing was sent, else re-raised so the
server cuts the connection (a truncated answer, never a fake end). Each hot endpoint answers its
own :class:`router.errors.RouterError`.

Two request shapes are settled here, ahead of every path (RFC 9112), for both of uvicorn's parsers:

- an absolute-form target (``POST http://host/route``, §3.2.2: a server MUST accept it) is served
  as its path; h11 hands it over whole (httptools already cuts it). The authority in it is
  dropped: nothing in the router connects by a client's say-so;
- a request with both ``Content-Length`` and ``Transfer-Encoding`` (§6.1: request smuggling
  behind a proxy that frames by the length) is answered 400 with ``Connection: close``, and the
  server closes the connection after that answer: whatever its body hid is never read as a
  request. (httptools refuses such a request itself: uvicorn's own plain-text 400, then close.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.edge.bodies import error_response
from router.errors import BadRequest, MethodNotAllowed, RouterError

__all__ = ["RouterApp", "origin_form"]

log = logging.getLogger("kvrouter.app")


class RouterApp:
    """What ``create_app`` returns. ``state`` is the FastAPI app's (``settings``, and ``kv``, the
    :class:`router.runtime.Runtime`, once the lifespan has started); ``api`` is the FastAPI
    app itself. ``hot`` maps each exact path to its plain ASGI endpoint: POST only."""

    def __init__(
        self, api: Any, hot: Mapping[str, ASGIApp], wrap: Callable[[ASGIApp], ASGIApp]
    ) -> None:
        self.api = api
        self.state = api.state
        self._hot = dict(hot)
        self._app = wrap(self._dispatch)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith("/"):
            scope = origin_form(scope)  # before the access log, tracing and the dispatch
        elif scope["type"] == "lifespan":
            send = self._lifespan_send(send)
        await self._app(scope, receive, send)

    def _lifespan_send(self, send: Send) -> Send:
        """A start-up failure the lifespan knows (``state.startup_error``, a
        :class:`router.errors.RouterError` that ``kvrouter serve`` prints as one line) reaches
        the server without Starlette's traceback of it, which uvicorn would log. Any other
        failure keeps its traceback: it is a bug."""

        async def sending(message: Message) -> None:
            failed = message["type"] == "lifespan.startup.failed"
            if failed and getattr(self.state, "startup_error", None) is not None:
                message = {"type": message["type"], "message": ""}
            await send(message)

        return sending

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _length_and_chunked(scope["headers"]):
            kv = getattr(self.state, "kv", None)
            if kv is not None:
                kv.metrics.rejected.labels("400").inc()
            bad = BadRequest(
                "a request may not carry both Content-Length and Transfer-Encoding "
                "(RFC 9112 section 6.1): the connection is closed"
            )
            # uvicorn closes the connection after an answer that says so, the body unread
            await _answer(scope, receive, send, bad, {"connection": "close"})
            return
        endpoint = self._hot.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.api(scope, receive, send)
        elif scope["method"] != "POST":
            self.state.kv.metrics.rejected.labels("405").inc()
            err = MethodNotAllowed(f"{scope['path']} takes POST")
            await _answer(scope, receive, send, err, {"allow": "POST"})
        else:
            await _guarded(endpoint, scope, receive, send)


def origin_form(scope: Scope) -> Scope:
    """``scope`` with an absolute-form target (``http://host:port/path``, any userinfo) cut to
    its path (``/`` when it has none), ``raw_path`` and ``path`` alike; any other target that
    does not start with ``/`` (``*``, another scheme) is left to answer 404."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode("latin-1")
    scheme, sep, rest = raw.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return scope
    slash = rest.find(b"/")
    raw_path = rest[slash:] if slash >= 0 else b"/"
    return {**scope, "raw_path": raw_path, "path": unquote(raw_path.decode("latin-1"))}


def _length_and_chunked(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    length = chunked = False
    for name, _ in headers:  # (lower case in an ASGI scope)
        if name == b"content-length":
            length = True
        elif name == b"transfer-encoding":
            chunked = True
    return length and chunked


async def _answer(
    scope: Scope, receive: Receive, send: Send, err: RouterError, headers: Any = None
) -> None:
    await error_response(err.status, err.message, err.type, headers, err.param)(
        scope, receive, send
    )


async def _guarded(endpoint: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    started = False

    async def tracked(message: Message) -> None:
        nonlocal started
        started = True
        await send(message)

    try:
        await endpoint(scope, receive, tracked)
    except Exception:
        log.exception("unhandled error on %s %s", scope["method"], scope["path"])
        if started:
            raise
        await _answer(scope, receive, send, RouterError("internal router error"))
