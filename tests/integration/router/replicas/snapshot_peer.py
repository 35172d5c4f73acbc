"""A stand-in snapshot peer for the warm-start tests: a real aiohttp server on 127.0.0.1 port 0
answering ``GET /admin/snapshot`` with the bytes a test crafted (optionally chunked, without a
Content-Length), keeping the headers of every request; and its fixture, ``snapshot_server``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from router.runtime.replicas import SNAPSHOT_PATH, SNAPSHOT_TYPE

__all__ = ["SnapshotServer", "snapshot_server"]


class SnapshotServer:
    """Serves ``body``; ``chunked``: in 64 KiB chunks, without a Content-Length."""

    def __init__(self, body: bytes, chunked: bool = False) -> None:
        self.body = body
        self.chunked = chunked
        self.seen: list[dict[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> SnapshotServer:
        async def serve(request: web.Request) -> web.StreamResponse:
            self.seen.append({k.lower(): v for k, v in request.headers.items()})
            if not self.chunked:
                return web.Response(body=self.body, content_type=SNAPSHOT_TYPE)
            resp = web.StreamResponse(headers={"content-type": SNAPSHOT_TYPE})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, len(self.body), 1 << 16):
                await resp.write(self.body[i : i + (1 << 16)])
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_get(SNAPSHOT_PATH, serve)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def snapshot_server() -> AsyncIterator[Callable[..., Awaitable[SnapshotServer]]]:
    made: list[SnapshotServer] = []

    async def make(body: bytes, chunked: bool = False) -> SnapshotServer:
        made.append(await SnapshotServer(body, chunked).start())
        return made[-1]

    yield make
    for s in made:
        await s.aclose()
