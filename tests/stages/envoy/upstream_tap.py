"""A recording forwarder in front of one bundled engine: the stage registers the tap's address as
the worker's URL, so every request Envoy sends to that worker passes through it and leaves a
:class:`Seen` record (which tap it reached, the exact body bytes, how they were framed, whether
the upstream answer has ended). Everything is forwarded as it comes, the response streamed
chunk by chunk, except a request with ``x-tap-digest: 1``, which the tap answers itself with the
digest of the body it received (the byte-identity check of a body too large for the engine).

A real HTTP server (aiohttp) on 127.0.0.1, port 0, in its own thread and event loop."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass

import aiohttp
from aiohttp import web

__all__ = ["Seen", "Tap"]

DIGEST_HEADER = "x-tap-digest"
# hop-by-hop or recomputed headers, never copied across the tap
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}


@dataclass
class Seen:
    method: str
    path: str
    request_id: str
    body: bytes
    chunked: bool  # Transfer-Encoding: chunked (no Content-Length) on the way in
    content_length: str | None
    test_id: str
    answered: bool = False  # the upstream answer has ended


class Tap:
    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target.rstrip("/")
        self.seen: list[Seen] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tap-{name}")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def posts(self) -> list[Seen]:
        return [s for s in list(self.seen) if s.method == "POST"]

    def start(self) -> str:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self.url

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    async def _start(self) -> str:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=120), auto_decompress=False
        )
        app = web.Application(client_max_size=16 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen = Seen(
            method=request.method,
            path=request.path_qs,
            request_id=request.headers.get("x-request-id", ""),
            body=body,
            chunked=request.headers.get("transfer-encoding", "").lower() == "chunked",
            content_length=request.headers.get("content-length"),
            test_id=request.headers.get("x-test-id", ""),
        )
        self.seen.append(seen)
        if request.headers.get(DIGEST_HEADER) == "1":
            seen.answered = True
            return web.json_response(
                {"tap": self.name, "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
            )
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(
            request.method, self.target + request.path_qs, headers=headers, data=body or None
        ) as up:
            resp = web.StreamResponse(status=up.status)
            for k, v in up.headers.items():
                if k.lower() not in _HOP:
                    resp.headers[k] = v
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)  # each chunk leaves now: a buffered stream would show
            seen.answered = True
            await resp.write_eof()
            return resp
