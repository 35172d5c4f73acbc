"""Fixtures of the EPP's tests: a router with its endpoint picker on (port 0, TLS with its
self-signed certificate unless a test says otherwise), and a real gRPC client playing Envoy's
part (:mod:`epp_envoy`), trusting the certificate the picker serves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

pytest.importorskip("grpc", reason="the epp extra")

import grpc
from epp_envoy import Envoy, served_certificate


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
        if "creds" not in client and not overrides["epp"].get("plaintext"):
            pem = await served_certificate(port)
            client["creds"] = grpc.ssl_channel_credentials(root_certificates=pem)
        envoy = Envoy(port, **client)
        made.append(envoy)
        return r, envoy

    yield make
    for e in made:
        await e.aclose()
