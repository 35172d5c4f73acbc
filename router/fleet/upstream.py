"""The router's one HTTP client, for everything it calls on workers: proxied requests, health
checks, ``/metrics`` scrapes, ``/v1/models`` and the ``worker`` tokenizer.

A thin layer over aiohttp's ``ClientSession`` (its C llhttp parser and connection pool). HTTP
framing is aiohttp's, not ours: a response whose body runs past its ``Content-Length`` is never
read as the next exchange's answer (aiohttp closes such a connection instead of pooling it),
informational ``1xx`` heads are skipped, malformed lengths and chunk sizes are rejected, and
``https://`` workers work. What this layer adds is the router's policy:

- no retry of a non-idempotent request by the client itself (aiohttp retries only idempotent
  methods on a stale keep-alive connection); the proxy moves a request to another worker only on
  :class:`ConnectError`, when the worker provably received nothing;
- an overall deadline for the response head (``read_s``), so a worker trickling header lines
  cannot hold a request past it; each later body read has ``read_s`` too;
- a cap on buffered (non-streaming) bodies, ``max_body_bytes``: over it, :class:`BodyTooLarge`;
- no ``Accept-Encoding`` upstream and no decompression: bytes pass through as the worker sent
  them, and closing a response before its end closes its connection (how a worker learns its
  client went away).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Sequence

import aiohttp

__all__ = [
    "BodyTooLarge",
    "ConnectError",
    "ConnectTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
]


class UpstreamError(Exception):
    """A worker exchange failed."""


class ConnectError(UpstreamError):
    """The connection could not be made: the worker received nothing."""


class ConnectTimeout(ConnectError):
    pass


class ReadTimeout(UpstreamError):
    pass


class ReadError(UpstreamError):
    pass


class RemoteProtocolError(UpstreamError):
    pass


class BodyTooLarge(UpstreamError):
    pass


def _mapped(e: BaseException, what: str) -> UpstreamError:
    """aiohttp's exception tree onto ours (the proxy decides on retries by these classes)."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return ConnectTimeout(f"{what}: connect timed out")
    if isinstance(e, aiohttp.ClientConnectorError):
        return ConnectError(f"{what}: connect failed: {e}")
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return ReadTimeout(f"{what}: timed out")
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return ReadError(f"{what}: {type(e).__name__}: {e}")
    if isinstance(e, aiohttp.InvalidURL):
        return ConnectError(f"{what}: invalid URL")
    # the first line only: the parser's message quotes the worker's bytes, which are not the
    # client's to see in an error
    reason = getattr(e, "message", None) or str(e)
    first = str(reason).splitlines()[0][:80] if str(reason) else ""
    return RemoteProtocolError(f"{what}: {type(e).__name__}: {first}")


class UpstreamResponse:
    """Status and headers are read; the body is read with ``read`` or ``iter_chunks``."""

    def __init__(self, pool: UpstreamPool, resp: aiohttp.ClientResponse, what: str) -> None:
        self._pool = pool
        self._resp = resp
        self._what = what
        self.status_code = resp.status
        self.headers = [(k.lower(), v) for k, v in resp.headers.items()]

    def header(self, name: str, default: str | None = None) -> str | None:
        return self._resp.headers.get(name, default)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for data in self._resp.content.iter_any():
                yield data
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _mapped(e, self._what) from e

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body, at most ``limit`` bytes (default: the pool's ``max_body_bytes``)."""
        limit = self._pool.max_body_bytes if limit is None else limit
        declared = self._resp.content_length
        if declared is not None and declared > limit:
            raise BodyTooLarge(f"{self._what}: body of {declared} bytes over {limit}")
        parts, size = [], 0
        async for data in self.iter_chunks():
            size += len(data)
            if size > limit:
                raise BodyTooLarge(f"{self._what}: body over {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    async def aclose(self) -> None:
        if self._resp.content.is_eof():
            self._resp.release()  # whole: the connection may be pooled
        else:
            self._resp.close()  # unread bytes: the connection goes


class UpstreamPool:
    """One aiohttp session for the router; made on first use, on the running loop."""

    def __init__(
        self,
        *,
        connect_s: float,
        read_s: float,
        write_s: float,
        keepalive_s: float = 0.0,
        max_per_worker: int = 0,
        pool_wait_s: float = 10.0,
        max_body_bytes: int = 64 << 20,
        ca_file: str | None = None,
    ) -> None:
        self.connect_s = connect_s
        self.read_s = read_s
        self.write_s = write_s  # the head deadline covers sending the (small) request body
        self.keepalive_s = keepalive_s
        self.max_per_worker = max_per_worker
        self.pool_wait_s = pool_wait_s
        self.max_body_bytes = max_body_bytes
        # https:// workers are verified against the system's CAs, or only against ca_file's
        self._tls: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=ca_file) if ca_file else True
        )
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Idle connections are kept keepalive_s for reuse (0: one exchange per connection).
            # A reused connection is safe for the next client: aiohttp closes, never pools, a
            # connection whose worker sent more than its framing said, and a connection the
            # worker closed is dropped from the pool on its FIN. keepalive_s stays under the
            # workers' own idle timeout (uvicorn's, so vLLM's and SGLang's: 5 s), which leaves
            # only a FIN in flight as a stale reuse: that request fails with 502, never retried.
            pooled = self.keepalive_s > 0
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0,
                    limit_per_host=self.max_per_worker,
                    force_close=not pooled,
                    keepalive_timeout=self.keepalive_s if pooled else None,
                    ssl=self._tls,
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    # a free connection (max_per_worker), then the TCP connect
                    connect=self.pool_wait_s + self.connect_s if self.max_per_worker else None,
                    sock_connect=self.connect_s,
                    sock_read=self.read_s,
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                raise_for_status=False,
            )
        return self._session

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send the request; return once the response head is read (within ``read_s``)."""
        url = base_url.rstrip("/") + path
        what = f"{method} {url}"
        if not url.startswith(("http://", "https://")):
            raise ConnectError(f"{what}: unsupported URL (http:// or https:// only)")
        sent = self._client().request(
            method, url, data=body or None, headers=list(headers), allow_redirects=False
        )
        try:
            resp = await asyncio.wait_for(sent, self.read_s + self.connect_s)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise _mapped(e, what) from e
        return UpstreamResponse(self, resp, what)

    async def get(
        self, base_url: str, path: str, timeout_s: float, max_bytes: int = 1 << 20
    ) -> tuple[int, bytes]:
        """A small ``GET`` (health checks, scraping, model lists): status and whole body within
        ``timeout_s``, at most ``max_bytes``; raises :class:`UpstreamError`."""

        async def exchange() -> tuple[int, bytes]:
            resp = await self.request(base_url, "GET", path, (), b"")
            try:
                return resp.status_code, await resp.read(max_bytes)
            finally:
                await resp.aclose()

        try:
            return await asyncio.wait_for(exchange(), timeout_s)
        except asyncio.TimeoutError as e:
            raise ReadTimeout(f"GET {base_url}{path} took over {timeout_s} s") from e

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
