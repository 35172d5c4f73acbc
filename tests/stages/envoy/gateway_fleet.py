"""The processes of the Envoy stage: bundled engines behind recording taps
(:mod:`upstream_tap`), a router with its endpoint picker on (``epp.port: 0``, the bound port read
back from its log line), and a real Envoy on the committed config (:mod:`gateway_config`),
started by :class:`kvrouter.gateway.EnvoyProcess` (admin and listener ports read back from its
admin API). All on 127.0.0.1, every port bound 0."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from gateway_config import for_test
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from upstream_tap import Tap

from kvrouter.gateway import EPP_ENV, EPP_READY, EnvoyProcess, answer_head_only, load
from kvrouter.up import (
    ENGINE_READY,
    ROUTER_READY,
    Child,
    engine_argv,
    router_argv,
    spawn,
    stop_children,
)
from tests.waiting import poll

__all__ = [
    "ADMIN_KEY",
    "EXT_PROC_SERVICE",
    "Envoy",
    "Router",
    "Worker",
    "epp_channel",
    "epp_health",
    "metric",
    "start_engines",
    "start_router",
]

ADMIN_KEY = "envoy-stage-admin-key"
_START_S = 90.0
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass
class Worker:
    """One engine and the tap in front of it: ``endpoint`` is what the EPP names (the tap's)."""

    name: str
    engine: Child
    tap: Tap
    events: str
    replay: str

    @property
    def endpoint(self) -> str:
        return self.tap.url.removeprefix("http://")

    def spec(self) -> str:
        return f"id={self.name},url={self.tap.url},events={self.events},replay={self.replay}"


def start_engines(n: int, log: Any, stop: threading.Event) -> list[Worker]:
    """``n`` sim engines (real time: a 64-token answer streams for about half a second)."""
    children = [spawn(f"engine-{i}", engine_argv(i, speedup=1.0), log=log) for i in range(n)]
    workers: list[Worker] = []
    try:
        for c in children:
            url, events, replay = c.wait_line(ENGINE_READY, _START_S, stop).groups()
            tap = Tap(c.name, url)
            workers.append(Worker(c.name, c, tap, events, replay))
            tap.start()
    except BaseException:
        for w in workers:
            w.tap.stop()
        stop_children(children)
        raise
    return workers


@dataclass
class Router:
    child: Child
    url: str
    epp_port: int
    workers: list[Worker] = field(default_factory=list)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def workers_view(self) -> list[dict[str, Any]]:
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.get(self.url + "/workers", headers=auth, timeout=10).json()["workers"]  # type: ignore[no-any-return]


def start_router(workers: Sequence[Worker], log: Any, stop: threading.Event) -> Router:
    """``kvrouter serve`` (``python -m router``) in front of ``workers``, its EPP on a free port;
    returns once ``/ready`` says a worker is live."""
    env = {
        **EPP_ENV,
        "KVROUTER_ADMIN_KEY": ADMIN_KEY,
        "KVROUTER_HEALTH__INTERVAL_S": "0.5",  # workers live sooner: a faster start
    }
    child = spawn("router", router_argv([w.spec() for w in workers]), log=log, env=env)
    try:
        url = child.wait_line(ROUTER_READY, _START_S, stop).group(1)
        epp = child.wait_line(EPP_READY, _START_S, stop)
        poll(lambda: _all_ready(url), _START_S, "the router and all its workers ready", every=0.1)
        port = int(epp.group(2))
        poll(lambda: epp_health(port, EXT_PROC_SERVICE), _START_S, "the EPP SERVING", every=0.1)
    except BaseException:
        stop_children([child])
        raise
    return Router(child, url, port, list(workers))


def epp_channel(port: int) -> grpc.Channel:
    """A gRPC channel to the EPP over TLS (its default), trusting the self-signed certificate it
    serves, read off a handshake that verifies nothing (as Envoy's cluster does not)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    with raw, ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    pem = ssl.DER_cert_to_PEM_cert(der).encode()
    creds = grpc.ssl_channel_credentials(root_certificates=pem)
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


def epp_health(port: int, service: str) -> bool:
    """Whether the EPP's gRPC health service says ``service`` is SERVING."""
    try:
        channel = epp_channel(port)
    except OSError:  # (not listening yet)
        return False
    with channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        try:
            got = check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError:
            return False
        return bool(got.status == health_pb2.HealthCheckResponse.SERVING)


def _all_ready(url: str) -> bool:
    try:
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        view = httpx.get(url + "/workers", headers=auth, timeout=5).json()["workers"]
        ok = httpx.get(url + "/ready", timeout=5).status_code == 200
        return ok and all(w["healthy"] and w["ready"] for w in view)
    except httpx.HTTPError:
        return False


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and labels.items() <= s.labels.items():
                total += s.value
    return total


class Envoy(EnvoyProcess):
    """A real Envoy on ``deploy/gateway/envoy.yaml`` (made loopback by :func:`for_test`),
    started by :class:`kvrouter.gateway.EnvoyProcess` in ``tmp``; ``stop()`` stops it."""

    def __init__(self, binary: str, tmp: Path, epp_port: int, *, head_only: bool = False) -> None:
        self.access_log = tmp / "access.log"
        config = for_test(load(), epp_port=epp_port, access_log=self.access_log)
        if head_only:  # the answer's head and end reach the EPP, not its body
            answer_head_only(config)
        # the access log reaches its file within 20 ms, not the default 10 s
        flush = ["--file-flush-interval-msec", "20"]
        super().__init__(config, binary=binary, workdir=tmp, extra_args=flush)
        self.start()

    def log_lines(self) -> list[dict[str, Any]]:
        if not self.access_log.exists():
            return []
        lines = self.access_log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def logged(self, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """The access log line of ``request_id`` (Envoy writes it when the stream ends)."""

        def find() -> dict[str, Any] | None:
            found = [e for e in self.log_lines() if e.get("request_id") == request_id]
            return found[0] if found else None

        return poll(find, timeout, f"the access log line of {request_id}")  # type: ignore[no-any-return]
