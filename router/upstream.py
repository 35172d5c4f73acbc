"""A lean HTTP/1.1 client for the proxy's hot path: asyncio streams and a keep-alive pool per worker.

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
import sys
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

if sys.version_info >= (3, 11):

    async def _within(aw: Awaitable[T], seconds: float) -> T:
        # no extra task per read, unlike wait_for before 3.12
        async with asyncio.timeout(seconds):
            return await aw

else:  # pragma: no cover - CI runs 3.11

    async def _within(aw: Awaitable[T], seconds: float) -> T:
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


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()


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

    async def _read(self, aw: Awaitable[bytes]) -> bytes:
        try:
            return await _within(aw, self._pool.read_s)
        except asyncio.TimeoutError as e:
            raise ReadTimeout(f"no data from upstream in {self._pool.read_s} s") from e
        except asyncio.IncompleteReadError as e:
            raise ReadError("upstream closed the connection mid-body") from e
        except (OSError, asyncio.LimitOverrunError, ValueError) as e:
            raise ReadError(f"upstream read failed: {e!r}") from e

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None or self._done:
            return
        r = conn.reader
        if self._chunked:
            while True:
                line = await self._read(r.readuntil(b"\r\n"))
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError as e:
                    raise RemoteProtocolError(f"bad chunk size line {line[:40]!r}") from e
                if size == 0:
                    while (await self._read(r.readuntil(b"\r\n"))) != b"\r\n":
                        pass  # trailers
                    break
                data = await self._read(r.readexactly(size + 2))
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                data = await self._read(r.read(min(left, _READ_CHUNK)))
                if not data:
                    raise ReadError("upstream closed the connection mid-body")
                left -= len(data)
                yield data
        else:
            while True:
                data = await self._read(r.read(_READ_CHUNK))
                if not data:
                    break
                yield data
        self._done = True

    async def read(self) -> bytes:
        conn = self._conn
        if conn is None or self._done:
            return b""
        if self._length is not None and not self._chunked:
            data = await self._read(conn.reader.readexactly(self._length))
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

    def _release(self, key: str, conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle and conn.usable():
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, host: str, port: int) -> _Conn:
        try:
            reader, writer = await _within(
                asyncio.open_connection(host, port, limit=1 << 20), self.connect_s
            )
        except asyncio.TimeoutError as e:
            raise ConnectTimeout(f"connect to {host}:{port} timed out") from e
        except OSError as e:
            raise ConnectError(f"connect to {host}:{port} failed: {e}") from e
        return _Conn(reader, writer)

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send the request; return once the response head is read."""
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ConnectError(f"unsupported upstream URL {base_url!r} (http:// only)")
        host, port = u.hostname, u.port or 80
        prefix = u.path.rstrip("/")
        head = [f"{method} {prefix}{path} HTTP/1.1\r\nHost: {u.netloc}\r\n"]
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
            w = conn.writer
            w.write(payload)
            try:
                if w.transport.get_write_buffer_size():
                    await _within(w.drain(), self.write_s)
            except asyncio.TimeoutError as e:
                raise ReadTimeout(f"sending the request took over {self.write_s} s") from e
            except OSError as e:
                raise ReadError(f"upstream write failed: {e!r}") from e
            try:
                raw = await _within(conn.reader.readuntil(b"\r\n\r\n"), self.read_s)
            except asyncio.TimeoutError as e:
                raise ReadTimeout(f"no response from upstream in {self.read_s} s") from e
            except asyncio.IncompleteReadError as e:
                raise ReadError("upstream closed the connection before answering") from e
            except asyncio.LimitOverrunError as e:
                raise RemoteProtocolError("upstream response head too large") from e
            except OSError as e:
                raise ReadError(f"upstream read failed: {e!r}") from e
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
