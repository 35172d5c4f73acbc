"""Serving a router app: uvicorn, through its public ``Config``, with the router's front-end limits.

Every request goes through ASGI; HTTP parsing and framing are uvicorn's: its h11 protocol by
default (``server.http``), which bounds the request head and keeps the body of a POST that also
proposes an ``Upgrade: h2c``; ``httptools`` is faster but has neither property (uvicorn 0.54). There is no protocol subclass here: an earlier one, built on uvicorn internals to save
microseconds, let pipelined and malformed input through in ways a maintained server does not.

What the router asks of uvicorn (``server:`` in the config):

- ``max_connections``, or less where the file descriptors would run out first
  (:func:`connection_limits`): the cap on client connections. uvicorn accepts every connection
  and its ``limit_concurrency`` only answers requests, so an idle one past it would still hold a
  descriptor until the head deadline; :class:`ConnectionGate` (the ``http`` protocol factory
  uvicorn takes) answers a connection past the cap 503 the moment it is accepted (OpenAI's
  error shape, ``Connection: close``) and hands any other to uvicorn's own protocol. The soft
  ``RLIMIT_NOFILE`` is raised to the hard limit first, as servers commonly do, and the cap
  leaves a reserve for the router's own descriptors: connections to workers, ZMQ sockets, files;
  the listen backlog is bounded by that reserve too (one log line at start says all of it);
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
  answered as plain HTTP and no connection leaves uvicorn's HTTP protocol; uvicorn's two
  warnings for each such request (one of them "No supported WebSocket library detected"), which
  any client could write to the log at will, are filtered out of its ``uvicorn.error`` logger;
- ``drain_grace_s`` → ``timeout_graceful_shutdown``: after SIGTERM ``/ready`` answers 503 at once
  and in-flight requests (streams included) get this long to finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import socket
import time
from collections.abc import Callable
from typing import Any, cast

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from router.errors import ConfigError, ListenError, error_json

__all__ = [
    "ConnectionGate",
    "ConnectionLimits",
    "RouterServer",
    "bind_listener",
    "connection_limits",
    "raise_nofile_limit",
    "server_config",
]

log = logging.getLogger("kvrouter.http")

#: descriptors the process holds whatever its traffic: stdio, the listener, the event loop's,
#: the ZMQ context's I/O threads, log, snapshot and tokenizer files, DNS lookups
FILES = 64
#: per worker rank: its SUB socket, the SUB's monitor and a replay DEALER (a ZMQ mailbox each,
#: and a TCP connection for the SUB and the DEALER), one spare for a reconnect
ZMQ_PER_RANK = 6
#: per worker, outside the clients' share: its health check, /metrics scrape and /v1/models
HEALTH_PER_WORKER = 4
#: uvicorn's (and the kernel's usual) listen backlog, the most the router asks for
MAX_BACKLOG = 2048
#: a connection refused past the cap reads (and drops) its request this long at most
LINGER_S = 1.0


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    nofile: int  #: the soft RLIMIT_NOFILE they are derived from
    cap: int  #: client connections open at once (server.max_connections, or less)
    backlog: int  #: the listen backlog; as many refused connections may linger at once
    reserve: int  #: descriptors kept from the clients (nofile - cap)


def connection_limits(
    nofile: int,
    *,
    max_connections: int,
    per_worker: int,
    workers: int,
    ranks: int,
    dynamic: bool,
) -> ConnectionLimits:
    """The client connection cap that ``nofile`` descriptors allow next to the router's own.

    Kept first: :data:`FILES`, :data:`ZMQ_PER_RANK` per configured worker rank,
    :data:`HEALTH_PER_WORKER` per configured worker, and twice the listen backlog (a burst of
    connections accepted before the cap refuses them, and the refused ones still lingering).
    Of the rest, every client connection may hold one connection to a worker (its proxied
    request, or the ``worker`` tokenizer's call), and a fleet of ``workers`` takes at most
    ``per_worker`` (``proxy.max_connections``) each: the cap is the largest ``C`` with
    ``C + min(workers * per_worker, C)`` within it, ``C + C`` for a ``dynamic`` fleet (workers
    added at run time: discovery, ``POST /workers``), and at most ``max_connections``."""
    free = nofile - FILES - ZMQ_PER_RANK * ranks - HEALTH_PER_WORKER * workers
    backlog = min(MAX_BACKLOG, max(8, free // 16))
    free -= 2 * backlog
    upstream = free if dynamic else per_worker * workers  # connections to workers, at most
    cap = min(max_connections, max(free - upstream, free // 2))
    if cap < 1:
        raise ConfigError(
            f"RLIMIT_NOFILE {nofile} leaves no file descriptor for client connections next to "
            f"{workers} worker(s) and {ranks} ZMQ rank(s): raise it (ulimit -n)"
        )
    return ConnectionLimits(nofile, cap, backlog, nofile - cap)


def bind_listener(host: str, port: int, flag: str = "--port") -> socket.socket:
    """The router's listening socket, bound before anything else starts (so a port in use
    fails at once, in one line, not after the workers were subscribed to), inheritable by the
    processes of ``--processes N`` (each sets its own backlog again). :class:`ListenError`
    says what to do; ``flag`` is the option that named the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=MAX_BACKLOG)
    except OSError as e:
        raise ListenError.binding(host, port, e, flag) from e
    sock.set_inheritable(True)
    return sock


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit, as servers commonly do at start (the
    soft default, often 1024, is for select()-era programs; the router polls with epoll).
    Returns (the soft limit now, the soft limit before)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if infinite in (soft, hard) or soft >= hard:  # (no finite hard limit above it: as it is)
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:  # (a sandbox may refuse it)
        log.warning("RLIMIT_NOFILE stays %d: raising it to %d failed: %s", soft, hard, e)
        return soft, soft
    return hard, soft


def server_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config serving a router app (from :func:`router.edge.app.create_app`) with the
    limits of its settings; ``kwargs`` (host, port, log_level...) win. Raises the soft
    ``RLIMIT_NOFILE`` (:func:`raise_nofile_limit`) and logs the connection cap derived from it."""
    settings = app.state.settings
    s = settings.server
    nofile, before = raise_nofile_limit()
    workers, ranks = len(settings.workers), sum(w.dp_ranks for w in settings.workers)
    dynamic = _dynamic_fleet(settings)
    lim = connection_limits(
        1 << 24 if nofile == resource.RLIM_INFINITY else min(nofile, 1 << 24),
        max_connections=s.max_connections,
        per_worker=settings.proxy.max_connections,
        workers=workers,
        ranks=ranks,
        dynamic=dynamic,
    )
    log.info(
        "connections: at most %d clients (server.max_connections %d); RLIMIT_NOFILE %d%s, %d "
        "of it kept for %d configured worker(s)%s (proxy.max_connections %d each, %d ZMQ "
        "rank(s)), files and a listen backlog of %d",
        lim.cap, s.max_connections, lim.nofile,
        f" (raised from {before})" if before != nofile else "", lim.reserve, workers,
        " and any added later" if dynamic else "", settings.proxy.max_connections, ranks,
        lim.backlog,
    )  # fmt: skip
    http = kwargs.pop("http", s.http)
    protocol = import_from_string(HTTP_PROTOCOLS.get(http, http)) if isinstance(http, str) else http
    kwargs["http"] = ConnectionGate(protocol, lim.cap, lim.backlog, _refusal_counter(app.state))
    kwargs.setdefault("backlog", lim.backlog)
    kwargs.setdefault("lifespan", "on")
    kwargs.setdefault("ws", "none")  # no WebSocket endpoint: an Upgrade is plain HTTP
    kwargs.setdefault("server_header", False)  # the server software is nobody's business
    kwargs.setdefault("access_log", False)
    # the gate keeps connections to the cap; uvicorn's own limit (its 503 to a request while
    # that many connections or requests are open) only ever sees one more
    kwargs.setdefault("limit_concurrency", lim.cap + 1)
    kwargs.setdefault("timeout_keep_alive", s.keep_alive_timeout_s)
    kwargs.setdefault("h11_max_incomplete_event_size", s.max_header_bytes)
    kwargs.setdefault("timeout_graceful_shutdown", s.drain_grace_s)
    config = uvicorn.Config(app, **kwargs)
    if config.ws == "none":  # (after uvicorn's logging setup: a filter of our own on its logger)
        uvicorn_log = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, _UpgradeNoise) for f in uvicorn_log.filters):
            uvicorn_log.addFilter(_UpgradeNoise())
    return config


def _dynamic_fleet(settings: Any) -> bool:
    admin = settings.admin_key is not None or settings.admin_open  # POST /workers adds some
    return bool(not settings.workers or admin or settings.kubernetes.discovery.enabled)


def _refusal_counter(state: Any) -> Callable[[], None]:
    def refused() -> None:
        kv = getattr(state, "kv", None)
        if kv is not None:
            kv.metrics.closed_connections.labels("connection_cap").inc()

    return refused


class _UpgradeNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        noise = ("Unsupported upgrade request", "No supported WebSocket library detected")
        return not (isinstance(msg, str) and msg.startswith(noise))


class ConnectionGate:
    """uvicorn's ``http`` protocol factory: a connection accepted while ``cap`` client
    connections are open is answered 503 at once and closed; any other is given to uvicorn's
    own ``protocol`` (h11's or httptools'), which takes the transport over (``set_protocol``:
    nothing stands between them on any later read).

    A refused connection then reads and drops whatever its client sends until the client
    closes, :data:`LINGER_S` at most: closing with the client's request unread would reset the
    connection, and a reset can destroy the 503 before the client reads it. At most
    ``linger_max`` linger at once; past that a refused connection is closed at once."""

    def __init__(
        self,
        protocol: Callable[..., asyncio.Protocol],
        cap: int,
        linger_max: int,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.protocol = protocol
        self.cap = cap
        self.linger_max = linger_max
        self.on_refused = on_refused
        self.lingering: set[asyncio.BaseTransport] = set()
        body = error_json("the router is at its connection cap: retry later", "service_unavailable")
        self.answer = (
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%s"
            % (len(body), body)
        )

    def __call__(
        self, config: Any, server_state: Any, app_state: Any, _loop: Any = None
    ) -> asyncio.Protocol:
        return _Door(self, config, server_state, app_state, _loop)

    def close(self) -> None:
        """Close the refused connections still lingering (at shutdown)."""
        for transport in list(self.lingering):
            transport.close()


class _Door(asyncio.Protocol):
    """One accepted connection until it is let in (uvicorn's protocol takes over) or refused
    (then this protocol reads and drops until it closes)."""

    def __init__(
        self, gate: ConnectionGate, config: Any, server_state: Any, app_state: Any, loop: Any
    ) -> None:
        self._gate = gate
        self._args = (config, server_state, app_state, loop)
        self._transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop's are not asyncio's classes)
        gate = self._gate
        config, server_state, app_state, loop = self._args
        # uvicorn's protocols are in server_state.connections from their connection_made on
        if len(server_state.connections) < gate.cap:
            inner = gate.protocol(
                config=config, server_state=server_state, app_state=app_state, _loop=loop
            )
            transport.set_protocol(inner)
            inner.connection_made(transport)
            return
        gate.on_refused()
        transport.write(gate.answer)
        if len(gate.lingering) >= gate.linger_max or not transport.can_write_eof():
            transport.close()
            return
        self._transport = transport
        gate.lingering.add(transport)
        transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the refused request: dropped

    def eof_received(self) -> bool:
        return False  # the client is done: the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._transport is not None:
            self._gate.lingering.discard(self._transport)


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

    async def shutdown(self, sockets: Any = None) -> None:
        await super().shutdown(sockets)
        if isinstance(self.config.http, ConnectionGate):
            self.config.http.close()  # the refused connections still lingering

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
