"""The router's HTTP protocol: uvicorn's httptools protocol, plus the hot paths served directly.

Going through ASGI — a task per request, receive/send message dicts, the app's middleware stack,
a head and a body written separately — costs about as much as a whole ``/route`` answer on a
small machine (~80 µs of ~250), and a proxied request paid it on top of the worker's time. So
:class:`RouterHttpProtocol` collects the body of the two hot endpoints in its parser callbacks:

- ``POST /route`` with ``token_ids`` needs no await (the index is read synchronously: one
  writer, readers never await), so it is answered in ``on_message_complete``. A body with
  ``prompt`` or ``messages`` may need the tokenizer and goes to the app.
- ``POST /v1/completions`` and ``/v1/chat/completions`` run :func:`router.proxy.proxy_request`
  in one task that writes to the transport (a whole answer in one write, so the client wakes
  once); losing the connection cancels it.

Everything else goes to the app as uvicorn sends it. While a direct answer is in flight a
placeholder stands in uvicorn's ``cycle`` slot, so pipelined requests queue behind it as they
would behind an ASGI one. This builds on ``HttpToolsProtocol`` internals (``url``, ``headers``,
``cycle``, ``pipeline``, ``flow``, ``on_response_complete``), so pyproject pins uvicorn to a
tested range; every router test's server uses this class (:func:`server_config`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from http import HTTPStatus
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.errors import RouterError, error_json
from router.placement import route_answer_now
from router.proxy import Headers, Responder, proxy_request
from router.service import RouterState

__all__ = ["RouterHttpProtocol", "protocol_for", "server_config"]

log = logging.getLogger("kvrouter.http")


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("ascii")


#: a body over the limit is read and dropped up to this many times the limit, then cut off
_DISCARD_FACTOR = 8

_STATUS = {s: _status_line(s) for s in (200, 400, 404, 413, 422, 429, 500, 503)}


_PROXIED = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat"}


class _Direct:
    """A request being served directly: its body so far. ``endpoint``: None for ``/route``."""

    __slots__ = ("chunks", "done", "endpoint", "keep_alive", "limit", "size", "state", "t0")

    def __init__(
        self, state: RouterState, endpoint: str | None, limit: int, keep_alive: bool
    ) -> None:
        self.state = state
        self.endpoint = endpoint
        self.limit = limit
        self.keep_alive = keep_alive
        self.chunks: list[bytes] = []
        self.size = 0
        self.done = False  # answered early (413): the rest of the body is dropped
        self.t0 = time.perf_counter()


class _Busy:
    """Stands in uvicorn's ``cycle`` slot while a proxied answer is being written: pipelined
    requests queue behind it, and a server shutdown turns its keep-alive off."""

    __slots__ = ("disconnected", "keep_alive", "message_event", "response_complete")

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        self.message_event = asyncio.Event()


class _TransportOut(Responder):
    """The proxy's answer, written to the client's transport."""

    def __init__(self, proto: RouterHttpProtocol, busy: _Busy) -> None:
        self.proto = proto
        self.busy = busy
        self.started = False
        self.aborted = False

    def _head(self, status: int, headers: Headers, framing: bytes) -> list[bytes]:
        self.started = True
        return _head(self.proto, status, headers, framing, self.busy.keep_alive)

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        parts = self._head(status, headers, b"content-length: %d\r\n" % len(body))
        parts.append(body)
        self.proto.transport.write(b"".join(parts))

    async def start(self, status: int, headers: Headers) -> None:
        self.proto.transport.write(b"".join(self._head(status, headers, _CHUNKED)))

    async def chunk(self, data: bytes) -> None:
        flow = self.proto.flow
        if flow.write_paused:
            await flow.drain()
        self.proto.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    async def end(self) -> None:
        self.proto.transport.write(b"0\r\n\r\n")

    def abort(self) -> None:
        self.aborted = True
        self.proto.transport.close()


_CHUNKED = b"transfer-encoding: chunked\r\n"
_JSON = [(b"content-type", b"application/json")]


class RouterHttpProtocol(HttpToolsProtocol):
    """Set ``kv_app`` (the FastAPI app whose ``state.kv`` the lifespan fills) on a subclass:
    :func:`protocol_for` does."""

    kv_app: ClassVar[Any] = None
    _json_head: ClassVar[_JsonHead]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direct: _Direct | None = None
        self._task: asyncio.Task[None] | None = None
        self._idle_since: float | None = None  # None: a request is being read or answered

    # uvicorn arms a keep-alive timer after every answer and cancels it when the next request
    # arrives: two timer-heap operations per request. Here one timer stays armed while requests
    # keep coming, and when it fires it closes the connection only if it has been idle for the
    # whole keep-alive timeout (else it re-arms for the rest).

    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = None

    def on_response_complete(self) -> None:
        if self.pipeline or self.transport.is_closing():
            super().on_response_complete()  # starts the next pipelined request, or returns
            return
        self.server_state.total_requests += 1
        self.flow.resume_reading()
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self._keep_alive_due
            )

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        since = self._idle_since
        if since is None:
            return  # busy: the answer re-arms it
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def on_message_begin(self) -> None:
        # uvicorn's scope (a dict and a copy of the app state) is built only for requests the
        # app serves: see _app_scope
        self._direct = None
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def _app_scope(self) -> None:
        url, expect, headers = self.url, self.expect_100_continue, self.headers
        super().on_message_begin()
        self.url, self.expect_100_continue, self.headers = url, expect, headers
        self.scope["headers"] = headers

    def on_headers_complete(self) -> None:
        state = self._direct_state()
        if state is None:
            self._app_scope()
            super().on_headers_complete()
            return
        limit = state.settings.proxy.max_body_bytes
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        d = self._direct = _Direct(state, _PROXIED.get(self.url), limit, keep_alive)
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                self._too_large(
                    d, f"request body of {int(value)} bytes is over the {limit}-byte limit"
                )

    def _direct_state(self) -> RouterState | None:
        if (
            self.url != b"/route" and self.url not in _PROXIED
        ) or self.parser.get_method() != b"POST":
            return None
        if self.expect_100_continue or self.parser.should_upgrade():
            return None
        if self.pipeline or (self.cycle is not None and not self.cycle.response_complete):
            return None  # answers go out in request order: queue behind the one in flight
        app = self.kv_app
        return getattr(app.state, "kv", None) if app is not None else None

    def on_body(self, body: bytes) -> None:
        d = self._direct
        if d is None:
            super().on_body(body)
            return
        d.size += len(body)
        if d.done:
            if d.size > _DISCARD_FACTOR * d.limit:  # not going to stop: stop reading it
                self.transport.close()
            return
        if d.size > d.limit:
            self._too_large(d, f"request body is over the {d.limit}-byte limit")
            return
        d.chunks.append(body)

    def on_message_complete(self) -> None:
        d = self._direct
        if d is None:
            super().on_message_complete()
            return
        self._direct = None
        if d.done:
            self.transport.close()
            return
        body = d.chunks[0] if len(d.chunks) == 1 else b"".join(d.chunks)
        if d.endpoint is not None:
            busy = self.cycle = _Busy(d.keep_alive)  # type: ignore[assignment]
            # this request's headers now: a pipelined one parsed before the task runs replaces them
            task = self._task = self.loop.create_task(self._proxy(d, body, self.headers, busy))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        try:
            data = route_answer_now(d.state, body)
        except RouterError as e:
            d.state.metrics.rejected.labels(str(e.status)).inc()
            self._reply(e.status, error_json(e.message, e.type), d.keep_alive)
            return
        except Exception:
            log.exception("unhandled error on POST /route")
            self._reply(500, error_json("internal router error", "internal_error"), d.keep_alive)
            return
        if data is None:
            self._to_app(body)
            return
        self._reply(200, data, d.keep_alive)

    async def _proxy(
        self, d: _Direct, body: bytes, headers: list[tuple[bytes, bytes]], busy: _Busy
    ) -> None:
        out = _TransportOut(self, busy)
        state = d.state
        names = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        try:
            await proxy_request(state, d.endpoint or "", body, names.get, out, d.t0)
        except RouterError as e:
            state.metrics.rejected.labels(str(e.status)).inc()
            if out.started:  # proxy_request raises only before writing: never expected
                out.abort()
            else:
                await out.whole(e.status, _JSON, error_json(e.message, e.type))
        except Exception:
            log.exception("unhandled error on a proxied %s request", d.endpoint)
            if out.started:
                out.abort()
            else:
                await out.whole(500, _JSON, error_json("internal router error", "internal_error"))
        finally:
            self._task = None
        busy.response_complete = True
        if out.aborted or self.transport.is_closing():
            return
        if busy.keep_alive:
            self.on_response_complete()
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        task = self._task
        if task is not None:
            task.cancel()  # the client is gone: stop the upstream exchange
        timer = self.timeout_keep_alive_task
        if timer is not None:
            timer.cancel()
            self.timeout_keep_alive_task = None
        super().connection_lost(exc)

    def _too_large(self, d: _Direct, message: str) -> None:
        """Answer 413 now, then read and drop the rest of the body before closing: a client still
        sending would otherwise see a reset instead of the answer."""
        d.done = True
        d.chunks = []
        d.state.metrics.rejected.labels("413").inc()
        self._reply(
            413, error_json(message, "invalid_request_error"), keep_alive=False, close=False
        )

    def _to_app(self, body: bytes) -> None:
        """Hand the request, body already read, to the app as uvicorn would have."""
        self._app_scope()
        super().on_headers_complete()
        cycle = self.cycle
        cycle.body += body  # empty: nothing was fed to this cycle yet
        cycle.more_body = False
        cycle.message_event.set()

    def _reply(self, status: int, data: bytes, keep_alive: bool, close: bool = True) -> None:
        head = self._json_head.get(self, status, keep_alive)
        self.transport.write(b"%bcontent-length: %d\r\n\r\n%b" % (head, len(data), data))
        if keep_alive:
            self.on_response_complete()  # keep-alive timer, next pipelined request, request count
        elif close:
            self.transport.close()


def _head(
    proto: RouterHttpProtocol, status: int, headers: Headers, framing: bytes, keep_alive: bool
) -> list[bytes]:
    """Status line and headers of a direct answer (uvicorn's default ``date``/``server`` first),
    up to and including the blank line; ``framing`` is its content-length or chunked line."""
    parts = [_STATUS.get(status) or _status_line(status)]
    for name, value in (*proto.server_state.default_headers, *headers):
        parts += [name, b": ", value, b"\r\n"]
    parts.append(framing)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return parts


class _JsonHead:
    """The head of a direct JSON answer up to its content-length, rebuilt only when uvicorn
    replaces its default headers (each second, for the date)."""

    __slots__ = ("defaults", "heads")

    def __init__(self) -> None:
        self.defaults: object = None
        self.heads: dict[tuple[int, bool], bytes] = {}

    def get(self, proto: RouterHttpProtocol, status: int, keep_alive: bool) -> bytes:
        defaults = proto.server_state.default_headers
        if defaults is not self.defaults:
            self.defaults, self.heads = defaults, {}
        head = self.heads.get((status, keep_alive))
        if head is None:
            parts = _head(proto, status, _JSON, b"", keep_alive)
            head = self.heads[status, keep_alive] = b"".join(parts[:-1])  # up to the blank line
        return head


def protocol_for(app: Any) -> type[RouterHttpProtocol]:
    """The protocol class serving ``app`` (a router app from ``router.app.create_app``)."""
    return type(
        "RouterHttpProtocol", (RouterHttpProtocol,), {"kv_app": app, "_json_head": _JsonHead()}
    )


def server_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config that serves a router app with :class:`RouterHttpProtocol`."""
    kwargs.setdefault("lifespan", "on")
    kwargs.setdefault("access_log", False)
    return uvicorn.Config(app, http=protocol_for(app), **kwargs)
