"""Fixtures for router integration tests: a ZMQ context, fake workers and a router app, all real
servers on 127.0.0.1 (port 0) in the test's event loop."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio
from router_fakeworker import FakeWorker, ServerHandle, wait_for
from router_pdworker import PdFleet

from router.edge.app import create_app
from router.runtime import Runtime
from router.settings import load_settings


@pytest.fixture
def cert(tmp_path: Path) -> tuple[str, str]:
    """A self-signed certificate and key (PEM paths) for ``IP:127.0.0.1``, made by the
    ``openssl`` command: the TLS tests' worker and endpoint picker serve it, their clients trust
    it as the CA. No openssl is a failure, not a skip: these tests are the TLS checks."""
    openssl = shutil.which("openssl")
    assert openssl is not None, "the TLS tests need the openssl command"
    crt, key = tmp_path / "test.crt", tmp_path / "test.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=kvrouter-test", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(crt), str(key)


class RouterHandle:
    def __init__(self, server: ServerHandle, app: Any) -> None:
        self.server = server
        self.app = app

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self) -> Runtime:
        return self.app.state.kv  # type: ignore[no-any-return]

    def matched(self, tokens: list[int], worker: str, rank: int = 0) -> int:
        """Blocks of ``tokens`` the router's index holds on ``worker`` (read on the loop)."""
        index = self.state.index
        return index.match(index.request_hashes(tokens)).workers[(worker, rank)].matched_blocks

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await wait_for(self.state.all_ready, timeout, "every worker's event stream ready")


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)  # never blocks, even if a failed test left a socket open


@pytest.fixture
async def pd(zctx: zmq.asyncio.Context) -> AsyncIterator[PdFleet]:
    """Prefill/decode test workers (``router_pdworker``), closed after the test."""
    fleet = PdFleet(zctx)
    yield fleet
    await fleet.aclose()


@pytest.fixture
async def workers(zctx: zmq.asyncio.Context) -> AsyncIterator[Callable[..., Awaitable[FakeWorker]]]:
    made: list[FakeWorker] = []

    async def make(worker_id: str, **kw: Any) -> FakeWorker:
        w = await FakeWorker(worker_id, zctx, **kw).start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.aclose()


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Awaitable[RouterHandle]]]:
    made: list[RouterHandle] = []

    async def make(
        fake_workers: Sequence[FakeWorker] = (),
        *,
        ready: bool = True,
        plain_asgi: bool = False,
        **overrides: Any,
    ) -> RouterHandle:
        """``plain_asgi``: serve the app with uvicorn's defaults (httptools) instead of
        ``router.edge.server``'s config (h11 and the router's limits): both must answer alike."""
        overrides.setdefault("health", {"interval_s": 0.2, "timeout_s": 2.0})
        if "admin_key" not in overrides:  # tests that read /workers; auth has its own tests
            overrides.setdefault("admin_open", True)
        overrides.setdefault("workers", [w.spec() for w in fake_workers])
        settings = load_settings(environ={}, overrides=overrides)
        app = create_app(settings)
        h = RouterHandle(await ServerHandle(app, router=not plain_asgi).start(), app)
        made.append(h)
        if ready:
            await h.wait_ready()
        return h

    yield make
    for h in made:
        await h.server.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        yield c
