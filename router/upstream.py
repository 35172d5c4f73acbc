"""A lean HTTP/1.1 client for the proxy's hot path: a protocol per connection and a keep-alive pool
per worker.

httpx costs about 1.3 ms per request on the 2-core reference machine (anyio, httpcore, h11 and
header models); this client writes one pre-built request and parses the head itself, which keeps
the latency the router adds within budget. It speaks only what workers answer: Content-Length,
chunked or read-to-close bodies, keep-alive. Health checks and other cold paths keep using httpx.

Timeouts: ``connect_s`` for the TCP connect, ``read_s`` for each read (the response head — the
first byte — included), ``write_s`` for sending the request. A request sent on a reused idle
connection that the server had already closed (its keep-alive timeout) is retried once on a new
connection — only when not a single response byte arrived. Closing a response before its end (a
cancelled or abandoned request) closes the connection, which is how the worker learns that its
client went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

__all__ = [
    "ConnectError",
    "ConnectTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
]

T = TypeVar("T")
_READ_CHUNK = 65536
_HIGH_WATER = 1 << 20  # buffered, unread response bytes past which reading pauses


async def _within(aw: Awaitable[T], seconds: float) -> T:
    # cold paths only (connect, whole health-check GETs): reads arm their own timer, see _Conn
    return await asyncio.wait_for(aw, seconds)


class UpstreamError(Exception):
    """Base of the upstream client's errors."""


class ConnectError(UpstreamError):
    pass


class ConnectTimeout(ConnectError):
    pass


class ReadTimeout(UpstreamError):
    pass


class ReadError(UpstreamError):
    pass


class RemoteProtocolError(UpstreamError):
    pass


class _Conn(asyncio.Protocol):
    """One keep-alive connection: a protocol with its own small read buffer.

    asyncio streams cost ~75 µs a request here (a timeout context and a timer per read, the
    reader's waiter and wake-up per step); this reads straight from the buffer the protocol
    fills, and arms a timer only when it actually waits."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused = False  # reading paused: too much unread

    # -- protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > _HIGH_WATER and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake(self._waiter)

    def eof_received(self) -> bool:
        self.eof = True
        self._wake(self._waiter)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake(self._waiter)
        self._wake(self._drain)

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        self._wake(self._drain)
        self._drain = None

    @staticmethod
    def _wake(fut: asyncio.Future[None] | None) -> None:
        if fut is not None and not fut.done():
            fut.set_result(None)

    # -- the client side
    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def usable(self) -> bool:
        return not self.eof and self.transport is not None and not self.transport.is_closing()

    async def write(self, data: bytes, timeout_s: float) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ReadError("upstream connection is closed")
        self.transport.write(data)
        drain = self._drain
        if drain is not None:
            await self._wait(drain, timeout_s, f"sending the request took over {timeout_s} s")
            if self.transport.is_closing():
                raise ReadError("upstream connection closed while sending the request")

    async def _more(self, timeout_s: float, what: str) -> None:
        """Wait until more bytes (or the end) arrive."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        fut = self._waiter = self.loop.create_future()
        try:
            await self._wait(fut, timeout_s, what)
        finally:
            self._waiter = None

    async def _wait(self, fut: asyncio.Future[None], timeout_s: float, what: str) -> None:
        timer = self.loop.call_later(timeout_s, _time_out, fut)
        try:
            await fut
        except _TimedOut as e:
            raise ReadTimeout(what) from e
        finally:
            timer.cancel()

    def _ended(self, what: str) -> ReadError:
        e = self.error
        return ReadError(f"{what}: {e!r}" if e is not None else what)

    async def readuntil(self, sep: bytes, timeout_s: float, limit: int, what: str) -> bytes:
        start = 0
        while True:
            i = self.buf.find(sep, start)
            if i >= 0:
                end = i + len(sep)
                out = bytes(self.buf[:end])
                del self.buf[:end]
                return out
            if len(self.buf) > limit:
                raise RemoteProtocolError(f"upstream {what} too large")
            if self.eof:
                raise self._ended(f"upstream closed the connection before the {what} ended")
            start = max(0, len(self.buf) - len(sep) + 1)
            await self._more(timeout_s, f"no data from upstream in {timeout_s} s")

    async def readexactly(self, n: int, timeout_s: float) -> bytes:
        while len(self.buf) < n:
            if self.eof:
                raise self._ended("upstream closed the connection mid-body")
            await self._more(timeout_s, f"no data from upstream in {timeout_s} s")
        if len(self.buf) == n:
            out = bytes(self.buf)
            self.buf.clear()
        else:
            out = bytes(self.buf[:n])
            del self.buf[:n]
        return out

    async def read(self, n: int, timeout_s: float) -> bytes:
        """Up to ``n`` bytes; b"" at the end."""
        while not self.buf:
            if self.eof:
                if self.error is not None:
                    raise self._ended("upstream read failed")
                return b""
            await self._more(timeout_s, f"no data from upstream in {timeout_s} s")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


class _TimedOut(Exception):
    pass


def _time_out(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(_TimedOut())


class UpstreamResponse:
    """Status and headers are read; the body is read with ``read`` or ``iter_chunks``."""

    def __init__(
        self, pool: UpstreamPool, key: str, conn: _Conn, status: int, headers: list[tuple[str, str]]
    ) -> None:
        self.status_code = status
        self.headers = headers
        self._pool = pool
        self._key = key
        self._conn: _Conn | None = conn
        self._done = False
        length = None
        chunked = False
        self._keep_alive = True
        for name, value in headers:
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif name == "connection" and value.lower() == "close":
                self._keep_alive = False
        self._length = None if chunked else length
        self._chunked = chunked
        if not chunked and length is None:
            self._keep_alive = False  # the body ends when the server closes
        if status in (204, 304) or (length == 0 and not chunked):
            self._done = True

    def header(self, name: str, default: str | None = None) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return default

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None or self._done:
            return
        t = self._pool.read_s
        if self._chunked:
            while True:
                line = await conn.readuntil(b"\r\n", t, 4096, "chunk size line")
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError as e:
                    raise RemoteProtocolError(f"bad chunk size line {line[:40]!r}") from e
                if size == 0:
                    while (await conn.readuntil(b"\r\n", t, 65536, "trailer")) != b"\r\n":
                        pass  # trailers
                    break
                data = await conn.readexactly(size + 2, t)
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                data = await conn.read(min(left, _READ_CHUNK), t)
                if not data:
                    raise ReadError("upstream closed the connection mid-body")
                left -= len(data)
                yield data
        else:
            while True:
                data = await conn.read(_READ_CHUNK, t)
                if not data:
                    break
                yield data
        self._done = True

    async def read(self) -> bytes:
        conn = self._conn
        if conn is None or self._done:
            return b""
        if self._length is not None and not self._chunked:
            data = await conn.readexactly(self._length, self._pool.read_s)
            self._done = True
            return data
        return b"".join([c async for c in self.iter_chunks()])

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep_alive:
            self._pool._release(self._key, conn)
        else:
            conn.close()


class UpstreamPool:
    def __init__(
        self,
        *,
        connect_s: float,
        read_s: float,
        write_s: float,
        max_idle_per_origin: int = 64,
    ) -> None:
        self.connect_s = connect_s
        self.read_s = read_s
        self.write_s = write_s
        self.max_idle = max_idle_per_origin
        self._idle: dict[str, list[_Conn]] = {}
        self._origins: dict[str, tuple[str, int, str, str]] = {}

    def _release(self, key: str, conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle and conn.usable():
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await _within(
                loop.create_connection(lambda: _Conn(loop), host, port), self.connect_s
            )
        except asyncio.TimeoutError as e:
            raise ConnectTimeout(f"connect to {host}:{port} timed out") from e
        except OSError as e:
            raise ConnectError(f"connect to {host}:{port} failed: {e}") from e
        return conn

    def _origin(self, base_url: str) -> tuple[str, int, str, str]:
        """(host, port, path prefix, netloc) of a worker URL, parsed once."""
        o = self._origins.get(base_url)
        if o is None:
            u = urlsplit(base_url)
            if u.scheme != "http" or not u.hostname:
                raise ConnectError(f"unsupported upstream URL {base_url!r} (http:// only)")
            o = (u.hostname, u.port or 80, u.path.rstrip("/"), u.netloc)
            if len(self._origins) < 4096:
                self._origins[base_url] = o
        return o

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send the request; return once the response head is read."""
        host, port, prefix, netloc = self._origin(base_url)
        head = [f"{method} {prefix}{path} HTTP/1.1\r\nHost: {netloc}\r\n"]
        head.append(f"Content-Length: {len(body)}\r\n")
        for k, v in headers:
            head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        payload = "".join(head).encode("latin-1") + body
        key = f"{host}:{port}"
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.usable():
                conn.close()
                continue
            try:
                return await self._exchange(key, conn, payload)
            except (ReadError, RemoteProtocolError):
                # no response byte came back on a reused connection: the server had closed it
                # (keep-alive timeout) before reading the request, so sending it anew is safe
                pass
        return await self._exchange(key, await self._connect(host, port), payload)

    async def _exchange(self, key: str, conn: _Conn, payload: bytes) -> UpstreamResponse:
        ok = False
        try:
            await conn.write(payload, self.write_s)
            raw = await conn.readuntil(b"\r\n\r\n", self.read_s, 1 << 20, "response head")
            lines = raw.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
                raise RemoteProtocolError(f"bad status line {lines[0][:60]!r}")
            try:
                status = int(parts[1])
            except ValueError as e:
                raise RemoteProtocolError(f"bad status line {lines[0][:60]!r}") from e
            headers = []
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers.append((name.strip().lower(), value.strip()))
            try:
                resp = UpstreamResponse(self, key, conn, status, headers)
            except ValueError as e:
                raise RemoteProtocolError(f"bad response headers: {e}") from e
            ok = True
            return resp
        finally:
            if not ok:  # error or cancellation: the connection's state is unknown
                conn.close()

    async def get(self, base_url: str, path: str, timeout_s: float) -> tuple[int, bytes]:
        """A small ``GET`` (health checks, scraping): status and whole body within
        ``timeout_s``; raises :class:`UpstreamError`."""

        async def exchange() -> tuple[int, bytes]:
            resp = await self.request(base_url, "GET", path, (), b"")
            try:
                return resp.status_code, await resp.read()
            finally:
                await resp.aclose()

        try:
            return await _within(exchange(), timeout_s)
        except asyncio.TimeoutError as e:
            raise ReadTimeout(f"GET {base_url}{path} took over {timeout_s} s") from e

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
