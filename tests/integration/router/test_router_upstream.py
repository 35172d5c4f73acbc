"""``router.upstream``: the proxy's HTTP/1.1 client against small real servers on 127.0.0.1 that
answer exactly the bytes each test needs (framings, stale keep-alive, silence, cuts)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from router.upstream import (
    ConnectError,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    UpstreamPool,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    return head + await r.readexactly(n)


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_s=2, read_s=5, write_s=5)
    yield p
    await p.aclose()


async def fetch(pool: UpstreamPool, url: str, body: bytes = b"{}") -> tuple[int, bytes]:
    resp = await pool.request(url, "POST", "/v1/completions", [("X-A", "1")], body)
    try:
        return resp.status_code, await resp.read()
    finally:
        await resp.aclose()


async def test_content_length_answers_reuse_one_connection(pool: UpstreamPool) -> None:
    seen: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(r))
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Y: z\r\n\r\nhello")

    srv = Server(handler)
    async with srv as url:
        for _ in range(3):
            assert await fetch(pool, url, b'{"a": 1}') == (200, b"hello")
    assert srv.connections == 1
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Length: 8\r\nX-A: 1\r\n\r\n" in seen[0] and seen[0].endswith(b'{"a": 1}')


async def test_chunked_with_extensions_and_trailers(pool: UpstreamPool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n")
        await w.drain()
        w.write(b"6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
        await read_request(r)  # kept alive: a second request comes on the same connection
        w.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    srv = Server(handler)
    async with srv as url:
        resp = await pool.request(url, "POST", "/x", (), b"")
        assert [c async for c in resp.iter_chunks()] == [b"hello", b" world"]
        await resp.aclose()
        assert await fetch(pool, url) == (204, b"")
    assert srv.connections == 1


async def test_body_to_close_and_a_large_body(pool: UpstreamPool) -> None:
    big = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: past the read buffer's high water

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\n\r\n")
        for i in range(0, len(big), 100_000):
            w.write(big[i : i + 100_000])
            await w.drain()

    srv = Server(handler)
    async with srv as url:
        assert await fetch(pool, url) == (200, big)
        assert await fetch(pool, url) == (200, big)
    assert srv.connections == 2  # read-to-close bodies never return to the pool


async def test_stale_keep_alive_connection_is_retried_once(pool: UpstreamPool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        # then close without reading more: an idle keep-alive connection the server dropped

    srv = Server(handler)
    async with srv as url:
        assert await fetch(pool, url) == (200, b"ok")
        assert await fetch(pool, url) == (200, b"ok")
    assert srv.connections == 2


async def test_silence_is_a_read_timeout() -> None:
    pool = UpstreamPool(connect_s=2, read_s=0.2, write_s=5)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()  # never answers

    async with Server(handler) as url:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ReadTimeout):
            await fetch(pool, url)
        assert 0.15 < loop.time() - t0 < 3
    await pool.aclose()


async def test_cut_mid_body_and_bad_heads(pool: UpstreamPool) -> None:
    answers = iter(
        [
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",  # then closed
            b"SPDY/9 200 OK\r\n\r\n",
            b"HTTP/1.1 2xx OK\r\n\r\n",
        ]
    )

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(next(answers))
        await w.drain()

    async with Server(handler) as url:
        with pytest.raises(ReadError, match="mid-body"):
            await fetch(pool, url)
        with pytest.raises(RemoteProtocolError, match="bad status line"):
            await fetch(pool, url)
        with pytest.raises(RemoteProtocolError, match="bad status line"):
            await fetch(pool, url)


async def test_refused_connection_and_unsupported_urls(pool: UpstreamPool) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConnectError, match="failed"):
        await fetch(pool, f"http://127.0.0.1:{port}")
    with pytest.raises(ConnectError, match="http:// only"):
        await fetch(pool, "https://127.0.0.1:1")


async def test_abandoned_response_closes_its_connection(pool: UpstreamPool) -> None:
    closed = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await w.drain()
        assert await r.read() == b""  # the client closed: the worker learns it went away
        closed.set()

    async with Server(handler) as url:
        resp = await pool.request(url, "POST", "/x", (), b"")
        chunks = resp.iter_chunks()
        assert await chunks.__anext__() == b"abc"
        await resp.aclose()
        await asyncio.wait_for(closed.wait(), 5)
