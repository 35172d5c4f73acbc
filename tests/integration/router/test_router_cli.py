"""``python -m router`` as a real process: the listening line with the bound port, a served API,
a clean stop on SIGTERM, and a start-time failure that names the bad config key."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
LINE = re.compile(rb"kvrouter router listening on (http://127\.0\.0\.1:(\d+))")


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env = {k: v for k, v in env.items() if not k.startswith("KVROUTER_")}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT),
    )  # fmt: skip


async def test_serve_port_zero_prints_bound_url_and_stops_on_sigterm(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("scoring:\n  overlap_weight: 2.0\nserver:\n  head_timeout_s: 0.5\n")
    proc = await _spawn("serve", "--config", str(cfg), "--port", "0", "--admin-key", "k")
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        m = LINE.search(line)
        assert m, line
        url = m.group(1).decode()
        assert int(m.group(2)) > 0
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            assert (await c.get(url + "/health")).json() == {"status": "ok"}
            ready = await c.get(url + "/ready")
            assert ready.status_code == 503  # no worker: nothing to route to
            assert (await c.post(url + "/workers", json={})).status_code == 401
            r = await c.post(url + "/route", json={"token_ids": [1, 2, 3]})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            assert "server" not in r.headers  # the server software is not advertised
        # the served process enforces the head deadline: a silent connection is closed
        reader, writer = await asyncio.open_connection("127.0.0.1", int(m.group(2)))
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    # uvicorn shuts down gracefully (lifespan included), then re-raises the signal it caught
    assert b"Application shutdown complete" in err
    assert proc.returncode in (0, -signal.SIGTERM)


async def test_invalid_config_fails_at_start_naming_the_key(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("scoring:\n  overlap_weight: -1\n")
    proc = await _spawn("--config", str(cfg), "--port", "0")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"scoring.overlap_weight" in err and b"must be >= 0" in err
    proc = await _spawn("--port", "0", "--worker", "id=a,events=tcp://127.0.0.1:1")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"url=" in err
    # no events=: read from the worker's /kv_event_sources; nobody answers, so the start fails
    # naming the worker and what to give instead
    proc = await _spawn("--port", "0", "--worker", "id=a,url=http://127.0.0.1:1")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 4 and b"'a'" in err and b"give events=" in err


async def test_sigterm_drains_in_flight_requests_with_ready_503(tmp_path, workers):
    """SIGTERM: /ready answers 503 at once while the listener still serves, the request in
    flight finishes with its whole answer, then the process exits."""
    w = await workers("w", first_token_delay_s=1.5)
    cfg = tmp_path / "r.yaml"
    cfg.write_text("server:\n  drain_grace_s: 20\nhealth:\n  interval_s: 0.2\n")
    spec = f"id=w,url={w.url},events={w.spec()['events_endpoint']}"
    if w.spec().get("replay_endpoint"):
        spec += f",replay={w.spec()['replay_endpoint']}"
    proc = await _spawn("serve", "--config", str(cfg), "--port", "0", "--worker", spec)
    try:
        assert proc.stdout is not None
        m = LINE.search(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert m
        url = m.group(1).decode()
        async with httpx.AsyncClient(trust_env=False, timeout=30) as c:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while (await c.get(url + "/ready")).status_code != 200:
                assert loop.time() < deadline, "router never ready"
                await asyncio.sleep(0.05)
            slow = asyncio.create_task(c.post(url + "/v1/completions", json={"prompt": "hi"}))
            while w.running == 0:
                assert loop.time() < deadline, "request never reached the worker"
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            while (await c.get(url + "/ready")).status_code != 503:
                assert loop.time() < deadline, "/ready never turned 503"
                await asyncio.sleep(0.02)
            resp = await slow
            assert resp.status_code == 200 and resp.json()["choices"]
        await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
