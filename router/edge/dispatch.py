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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.edge.bodies import error_response
from router.errors import MethodNotAllowed, RouterError

__all__ = ["RouterApp"]

log = logging.getLogger("kvrouter.app")


class RouterApp:
    """What ``create_app`` returns. ``state`` is the FastAPI app's (``settings``, and ``kv``, the
    :class:`router.service.RouterState`, once the lifespan has started); ``api`` is the FastAPI
    app itself. ``hot`` maps each exact path to its plain ASGI endpoint: POST only."""

    def __init__(
        self, api: Any, hot: Mapping[str, ASGIApp], wrap: Callable[[ASGIApp], ASGIApp]
    ) -> None:
        self.api = api
        self.state = api.state
        self._hot = dict(hot)
        self._app = wrap(self._dispatch)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self._hot.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.api(scope, receive, send)
        elif scope["method"] != "POST":
            self.state.kv.metrics.rejected.labels("405").inc()
            err = MethodNotAllowed(f"{scope['path']} takes POST")
            await _answer(scope, receive, send, err, {"allow": "POST"})
        else:
            await _guarded(endpoint, scope, receive, send)


async def _answer(
    scope: Scope, receive: Receive, send: Send, err: RouterError, headers: Any = None
) -> None:
    await error_response(err.status, err.message, err.type, headers)(scope, receive, send)


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
