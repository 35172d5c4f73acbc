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
    cfg.write_text("scoring:\n  overlap_weight: 2.0\n")
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
            assert (
                await c.get(url + "/ready")
            ).status_code == 200  # no workers: nothing to wait for
            assert (await c.post(url + "/workers", json={})).status_code == 401
            r = await c.post(url + "/route", json={"token_ids": [1, 2, 3]})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
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
    proc = await _spawn("--port", "0", "--worker", "id=a,url=http://x")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"events=" in err
