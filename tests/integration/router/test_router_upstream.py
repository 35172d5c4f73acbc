"""``router.fleet.upstream``: the proxy's HTTP/1.1 client against small real servers on 127.0.0.1 that
answer exactly the bytes each test needs (framings, stale keep-alive, silence, cuts)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from router.fleet.upstream import (
    BodyTooLarge,
    ConnectError,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    UpstreamError,
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


async def test_content_length_answers_one_connection_each(pool: UpstreamPool) -> None:
    seen: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(r))
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Y: z\r\n\r\nhello")

    srv = Server(handler)
    async with srv as url:
        for _ in range(3):
            assert await fetch(pool, url, b'{"a": 1}') == (200, b"hello")
    assert srv.connections == 3  # no keep-alive to workers: nothing can carry over
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Length: 8\r\n" in seen[0] and b"\r\nX-A: 1\r\n" in seen[0]
    assert seen[0].endswith(b'{"a": 1}') and b"accept-encoding" not in seen[0].lower()


async def test_chunked_with_extensions_and_trailers(pool: UpstreamPool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n")
        await w.drain()
        w.write(b"6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")

    srv = Server(handler)
    async with srv as url:
        resp = await pool.request(url, "POST", "/x", (), b"")
        assert b"".join([c async for c in resp.iter_chunks()]) == b"hello world"
        await resp.aclose()


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
        with pytest.raises(ReadError, match="received 3 of 10 bytes"):
            await fetch(pool, url)
        with pytest.raises(RemoteProtocolError):
            await fetch(pool, url)
        with pytest.raises(RemoteProtocolError):
            await fetch(pool, url)


async def test_refused_connection_and_unsupported_urls(pool: UpstreamPool) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConnectError, match="failed"):
        await fetch(pool, f"http://127.0.0.1:{port}")
    with pytest.raises(ConnectError, match="failed"):  # https is spoken (nothing listens)
        await fetch(pool, f"https://127.0.0.1:{port}")
    with pytest.raises(ConnectError, match="unsupported URL"):
        await fetch(pool, "ftp://127.0.0.1:1")


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


# ---------------------------------------------------------------- hostile workers (issue 11)


async def test_bytes_past_content_length_never_answer_the_next_request(pool: UpstreamPool) -> None:
    """Pool poisoning: a worker answering ``{"a":1}`` with ``Content-Length: 2`` leaves 5 bytes on
    the connection; they must not become the next exchange's response."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            req = await read_request(r)
            if req.endswith(b"first"):
                w.write(b'HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{"a":1}')
            else:
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")
            await w.drain()

    srv = Server(handler)
    async with srv as url:
        try:  # the framing violation may surface as an error of that exchange itself
            assert await fetch(pool, url, b"first") == (200, b'{"')
        except UpstreamError:
            pass
        assert await fetch(pool, url, b"next") == (200, b"second")
    assert srv.connections == 2  # the poisoned connection was never reused


async def test_a_post_is_never_sent_twice(pool: UpstreamPool) -> None:
    """A reused connection that answers junk: the client reports the error and does not send
    the request again on a new connection (the worker may have acted on it)."""
    posts: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            posts.append(await read_request(r))
            if len(posts) == 1:
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            else:
                w.write(b"garbage that is no HTTP\r\n\r\n")
            await w.drain()

    async with Server(handler) as url:
        assert await fetch(pool, url) == (200, b"ok")
        with pytest.raises(UpstreamError):
            await fetch(pool, url, b"once")
    assert [p.endswith(b"once") for p in posts] == [False, True]


async def test_informational_heads_negative_lengths_and_bare_lf(pool: UpstreamPool) -> None:
    answers = iter(
        [
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nreal",
            b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\nxx",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\nxx\r\n0\r\n\r\n",
        ]
    )

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(next(answers))
        await w.drain()

    async with Server(handler) as url:
        assert await fetch(pool, url) == (200, b"real")  # 100 is not the final answer
        with pytest.raises(UpstreamError):
            await fetch(pool, url)
        with pytest.raises(UpstreamError):
            await fetch(pool, url)


async def test_trickled_head_hits_one_deadline() -> None:
    """One header line every 50 ms: each read is quick, the whole head is not."""
    pool = UpstreamPool(connect_s=2, read_s=0.5, write_s=5)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(200):
            w.write(b"X-%d: y\r\n" % i)
            await w.drain()
            await asyncio.sleep(0.05)  # the hostile peer's pacing, not a wait for state

    async with Server(handler) as url:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ReadTimeout):
            await fetch(pool, url)
        assert loop.time() - t0 < 3
    await pool.aclose()


async def test_buffered_bodies_are_capped() -> None:
    pool = UpstreamPool(connect_s=2, read_s=5, write_s=5, max_body_bytes=64 * 1024)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(64):  # 4 MiB, no declared length
            w.write(b"10000\r\n" + b"x" * 65536 + b"\r\n")
            await w.drain()
        w.write(b"0\r\n\r\n")

    async with Server(handler) as url:
        with pytest.raises(BodyTooLarge):
            await fetch(pool, url)
    await pool.aclose()
