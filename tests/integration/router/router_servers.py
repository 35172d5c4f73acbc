"""Running servers in a test's event loop: :class:`ServerHandle` (uvicorn on 127.0.0.1, port 0;
a router app with ``router.edge.server``'s config and server class), and :func:`wait_for`, the one way
the router's tests wait for state (a condition with a timeout, never a sleep)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import uvicorn

from router.edge.server import RouterServer, server_config
from tests.waiting import wait_for

__all__ = ["ServerHandle", "wait_for"]


class ServerHandle:
    """A uvicorn server on 127.0.0.1, port 0, in the running event loop. A router app
    (``router=True``) is served with ``router.edge.server``'s config, as ``kvrouter serve`` does."""

    def __init__(self, app: Any, *, router: bool = False, **config: Any) -> None:
        kw: dict[str, Any] = dict(
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        kw.update(config)
        self.scheme = "https" if kw.get("ssl_certfile") else "http"
        config = server_config(app, **kw) if router else uvicorn.Config(app, **kw)
        self.server = RouterServer(config) if router else uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> ServerHandle:
        self.task = asyncio.create_task(self.server.serve())
        await wait_for(lambda: self.server.started or self.task.done(), 30, "uvicorn start")
        if self.task.done():
            self.task.result()
            raise AssertionError("uvicorn exited at start")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.task, 30)
        self.task = None
