"""Serving a router app: uvicorn, through its public ``Config``, with the router's front-end limits.

Every request goes through ASGI; HTTP parsing and framing are uvicorn's: its h11 protocol by
default (``server.http``), which bounds the request head and keeps the body of a POST that also
proposes an ``Upgrade: h2c``; ``httptools`` is faster but has neither property (uvicorn 0.54). There is no protocol subclass here: an earlier one, built on uvicorn internals to save
microseconds, let pipelined and malformed input through in ways a maintained server does not.

What the router asks of uvicorn (``server:`` in the config):

- ``max_connections`` → ``limit_concurrency``: past it new connections and requests get 503,
  so idle sockets cannot exhaust the process's file descriptors;
- ``keep_alive_timeout_s`` → ``timeout_keep_alive``: an idle keep-alive connection is closed;
- ``max_header_bytes`` → ``h11_max_incomplete_event_size`` (with ``http: h11``);
- ``body_timeout_s``: enforced by :func:`router.edge.bodies.read_body` around the body it reads;
- ``head_timeout_s``: uvicorn has no head read timeout (a client may send one header byte every
  few seconds for ever, and any byte cancels its keep-alive timer), so :class:`RouterServer`
  enforces one: a connection with no request in progress — from accept, or from the end of its
  last answer, to a complete request head — for longer than this is closed. It runs on uvicorn's
  own 100 ms tick (``Server.on_tick``) and reads each connection's current request cycle; where a
  future uvicorn no longer exposes one, such connections are skipped and the log says so once
  (the slowloris test in ``tests/integration/router/test_router_http.py`` fails first);
- ``ws="none"``: the router has no WebSocket endpoint, so an ``Upgrade: websocket`` request is
  answered as plain HTTP and no connection leaves uvicorn's HTTP protocol;
- ``drain_grace_s`` → ``timeout_graceful_shutdown``: after SIGTERM ``/ready`` answers 503 at once
  and in-flight requests (streams included) get this long to finish.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import uvicorn

__all__ = ["RouterServer", "server_config"]

log = logging.getLogger("kvrouter.http")


def server_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config serving a router app (from :func:`router.edge.app.create_app`) with the
    limits of its settings; ``kwargs`` (host, port, log_level...) win."""
    s = app.state.settings.server
    kwargs.setdefault("http", s.http)
    kwargs.setdefault("lifespan", "on")
    kwargs.setdefault("ws", "none")  # no WebSocket endpoint: an Upgrade is plain HTTP
    kwargs.setdefault("server_header", False)  # the server software is nobody's business
    kwargs.setdefault("access_log", False)
    kwargs.setdefault("limit_concurrency", s.max_connections)
    kwargs.setdefault("timeout_keep_alive", s.keep_alive_timeout_s)
    kwargs.setdefault("h11_max_incomplete_event_size", s.max_header_bytes)
    kwargs.setdefault("timeout_graceful_shutdown", s.drain_grace_s)
    return uvicorn.Config(app, **kwargs)


class RouterServer(uvicorn.Server):
    """uvicorn's server with the router's head deadline (``server.head_timeout_s``)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        app: Any = config.app  # a router app (router.edge.app.create_app), as server_config takes
        self._head_timeout_s: float = app.state.settings.server.head_timeout_s
        self._app_state = app.state
        #: connection -> (since when it has had no request in progress, its request cycle then)
        self._waiting: dict[Any, tuple[float, Any]] = {}
        self._blind = False

    async def on_tick(self, counter: int) -> bool:
        self.enforce_head_deadline(time.monotonic())
        return await super().on_tick(counter)

    def enforce_head_deadline(self, now: float) -> int:
        """Close the connections that have waited for a request head past the deadline; returns
        how many were closed."""
        waiting: dict[Any, tuple[float, Any]] = {}
        closed = 0
        for conn in self.server_state.connections:
            if not hasattr(conn, "cycle") or not hasattr(conn, "transport"):
                # not uvicorn's HTTP protocol as this knows it: skipped, never closed blindly
                if not self._blind:
                    self._blind = True
                    log.warning("head_timeout_s not enforced on %s", type(conn).__name__)
                continue
            cycle = conn.cycle
            if cycle is not None and not cycle.response_complete:
                continue  # a request in progress: its body and its answer have their own limits
            # idle at this tick; a busy keep-alive connection may be idle at every tick, so a
            # new request cycle since the last one seen also restarts the clock
            since, seen = self._waiting.get(conn, (now, cycle))
            if seen is not cycle:
                since = now
            if now - since < self._head_timeout_s:
                waiting[conn] = (since, cycle)
            elif not conn.transport.is_closing():
                conn.transport.close()
                closed += 1
        self._waiting = waiting
        if closed:
            kv = getattr(self._app_state, "kv", None)
            if kv is not None:
                kv.metrics.closed_connections.labels("head_timeout").inc(closed)
        return closed
