"""The endpoint picker's server: its gRPC health service (liveness, readiness following the
router's, the ext_proc service, the whole server), TLS, one access-log line per stream, and
``kvrouter serve`` running it next to uvicorn on one uvloop event loop (a real process)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path

import grpc
import pytest
from epp_envoy import Envoy, headers_request, served_certificate
from grpc_health.v1.health_pb2 import HealthCheckResponse
from router_fakeworker import wait_for

from router.edge.epp.messages import endpoint_of
from router.edge.epp.server import EXT_PROC_SERVICE

ROOT = Path(__file__).resolve().parents[4]
SERVING, NOT_SERVING = HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING
NAMES = ("liveness", "readiness", EXT_PROC_SERVICE, "")


async def test_health_follows_readiness_and_liveness_is_up_at_once(workers, epp):
    a = await workers("a", replay_mode="hold")  # its event stream is not live until released
    r, envoy = await epp([a], ready=False)
    assert not r.state.ready()[0]
    assert await envoy.health("liveness") == SERVING
    for name in ("readiness", EXT_PROC_SERVICE, ""):
        assert await envoy.health(name) == NOT_SERVING, name
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await envoy.health("no-such-service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    await a.release_replay()
    await r.wait_ready()
    for name in NAMES:
        await envoy.wait_health(name, SERVING)
    r.state.draining = True  # SIGTERM: not ready any more, still alive
    await envoy.wait_health("readiness", NOT_SERVING)
    assert await envoy.health("liveness") == SERVING


async def test_one_access_line_per_stream(workers, epp, caplog):
    a = await workers("a")
    r, envoy = await epp([a])
    caplog.set_level(logging.INFO, logger="kvrouter.access")
    body = json.dumps({"model": "fake-model", "prompt": "logged"}).encode()
    p = await envoy.pick("/v1/completions?x=1", body, headers=[("x-request-id", "rq-42")])
    await p.call.write(headers_request([(":status", "200")], end=True, response=True))
    await p.call.read()
    await wait_for(lambda: r.state.placer.inflight == 0, 10)
    await wait_for(lambda: any(x.name == "kvrouter.access" for x in caplog.records), 10, "line")
    lines = [x for x in caplog.records if x.name == "kvrouter.access"]
    assert len(lines) == 1
    fields = lines[0].access  # type: ignore[attr-defined]
    assert fields["method"] == "POST" and fields["path"] == "/v1/completions"
    assert fields["status"] == 200 and fields["worker"] == "a"
    assert fields["request_id"] == "rq-42"


async def test_tls_round_trip(workers, epp, cert):
    a = await workers("a")
    crt, key = cert
    creds = grpc.ssl_channel_credentials(root_certificates=Path(crt).read_bytes())
    r, envoy = await epp([a], epp={"tls_cert": crt, "tls_key": key}, envoy={"creds": creds})
    await envoy.wait_health("readiness", SERVING)
    body = json.dumps({"model": "fake-model", "prompt": "over tls"}).encode()
    p = await envoy.pick("/v1/completions", body)
    assert p.endpoint == endpoint_of(a.url) and p.body == body
    p.call.cancel()
    plain = Envoy(r.app.state.epp_port)  # a plaintext client gets nothing from a TLS server
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await plain.health("liveness")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await plain.aclose()
    await wait_for(lambda: r.state.placer.inflight == 0, 10)


LISTENING = re.compile(rb"kvrouter router listening on http://127\.0\.0\.1:(\d+)")
EPP_LINE = re.compile(rb"^kvrouter EPP listening on 127\.0\.0\.1:(\d+)$")


async def test_kvrouter_serve_runs_the_epp_with_uvicorn_on_one_uvloop_loop(workers, http):
    pytest.importorskip("uvloop")
    a = await workers("a")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env.update(PYTHONPATH=str(ROOT), KVROUTER_EPP__PORT="0", PYTHONASYNCIODEBUG="0")
    spec = f"id=a,url={a.url},events={a.events_endpoint},replay={a.replay_endpoint}"
    code = (
        "import asyncio, sys, uvloop; from router import cli\n"
        "real = uvloop.run\n"
        "def run(main):\n"
        "    async def checked():\n"
        "        loop = type(asyncio.get_running_loop())\n"
        "        print('loop', loop.__module__, flush=True)\n"
        "        await main\n"
        "    real(checked())\n"
        "uvloop.run = run\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, "--port", "0", "--worker", spec,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    err = b""
    try:
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"loop uvloop"
        m = LISTENING.search(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert m, "no listening line"
        e = EPP_LINE.search(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert e, "no EPP line after the listening line"
        pem = await served_certificate(int(e.group(1)))  # (TLS, self-signed: the default)
        envoy = Envoy(int(e.group(1)), creds=grpc.ssl_channel_credentials(root_certificates=pem))
        try:
            url = f"http://127.0.0.1:{m.group(1).decode()}"
            assert (await http.get(url + "/health")).status_code == 200
            assert await envoy.health("liveness") == SERVING
            await envoy.wait_health("readiness", SERVING, 30)
            body = json.dumps({"model": "fake-model", "prompt": "served"}).encode()
            p = await envoy.pick("/v1/completions", body)
            assert p.endpoint == endpoint_of(a.url) and p.body == body
            status, _answer, _ = await p.forward(http, "/v1/completions", body, {})
            assert status == 200 and a.requests[-1]["prompt"] == "served"
            text = (await http.get(url + "/metrics")).text
            assert 'kvrouter_route_decisions_total{kind="epp",worker="a"} 1.0' in text
        finally:
            await envoy.aclose()
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, rest = await asyncio.wait_for(proc.communicate(), 30)
        print((err + rest).decode()[-6000:])
    err += rest
    assert b"Application shutdown complete" in err, err[-2000:]
    assert b"Traceback" not in err, err[-2000:]
    assert proc.returncode in (0, -signal.SIGTERM)


async def test_a_port_in_use_fails_the_start_naming_epp():
    from router.edge.app import create_app
    from router.errors import ConfigError
    from router.settings import load_settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        app = create_app(load_settings(environ={}, overrides={"epp": {"port": port}}))
        with pytest.raises(ConfigError, match=f"epp: cannot listen on 127.0.0.1:{port}"):
            async with app.api.router.lifespan_context(app.api):
                pass


async def test_a_stop_ends_the_open_streams_flights(workers, epp):
    a = await workers("a")
    r, envoy = await epp([a], epp={"shutdown_grace_s": 0.2})
    body = json.dumps({"model": "fake-model", "prompt": "held"}).encode()
    p = await envoy.pick("/v1/completions", body)  # picked; the answer never comes
    assert r.state.placer.inflight == 1 and r.state.placer.load.inflight("a") == 1
    await r.server.stop()  # the lifespan stops the EPP: grace, then the stream is cancelled
    assert r.state.placer.inflight == 0 and not r.state.placer.load.items()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await p.call.read()
    assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
