"""Fixtures of the EPP's tests: a router with its endpoint picker on (port 0), and a real gRPC
client playing Envoy's part (:mod:`epp_envoy`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
from epp_envoy import Envoy

pytest.importorskip("grpc", reason="the epp extra")


@pytest.fixture
async def epp(router: Any) -> AsyncIterator[Callable[..., Awaitable[tuple[Any, Envoy]]]]:
    """``await epp(workers, **overrides)``: a router serving the EPP, and an Envoy on it."""
    made: list[Envoy] = []

    async def make(fake_workers: Sequence[Any] = (), **overrides: Any) -> tuple[Any, Envoy]:
        client = overrides.pop("envoy", {})  # (the Envoy's own: TLS credentials)
        overrides["epp"] = {"port": 0, **overrides.get("epp", {})}
        r = await router(fake_workers, **overrides)
        port = r.app.state.epp_port
        assert port > 0
        envoy = Envoy(port, **client)
        made.append(envoy)
        return r, envoy

    yield make
    for e in made:
        await e.aclose()
