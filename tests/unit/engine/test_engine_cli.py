"""Command line: flag parsing, runner options passed through, the kvrouter dispatcher, and a real
engine process that registers with a router's /workers API and leaves it on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import serve, wait_for
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine.cli import TORCH_DECODE_STAGING, parse_args
from engine.cli import main as engine_main
from kvrouter.cli import main as kvrouter_main
from kvrouter.up import ENGINE_READY

ROOT = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def test_flags_and_runner_options() -> None:
    settings, _ = parse_args([
        "--port", "0", "--events", "none", "--gpu-blocks", "64", "--cpu-blocks", "8",
        "--external", "redis://127.0.0.1:6379/0", "--offload", "write-back",
        "--runner", "torch", "--model", "tiny-random:layers=2", "--device", "cpu",
        "--prefill-a", "1e-5", "--flag", "--kv=3",
    ])  # fmt: skip
    e = settings.engine
    assert settings.events is None and settings.replay == "tcp://127.0.0.1:5558"
    assert (e.num_gpu_blocks, e.num_cpu_blocks, e.offload) == (64, 8, "write-back")
    assert e.external_url == "redis://127.0.0.1:6379/0" and e.model == "tiny-random:layers=2"
    assert e.runner_options == {"prefill_a": "1e-5", "flag": True, "kv": "3", "device": "cpu"}
    assert e.model_len == 64 * 16


def test_decode_engine_stages_a_whole_pulled_prompt() -> None:
    """Issue 35: 64 staging slots cut a decode leg's pulled KV at 1,024 tokens and the decode
    engine re-prefilled the rest, doubling live PD TPOT; a sim decode engine's default fits the
    GPU, a torch one's is bounded (pinned KV blocks; a pull loads through them chunk by chunk)."""
    slots = {
        role: parse_args(["--role", role, "--gpu-blocks", "4096"])[0].engine.num_staging_slots
        for role in ("decode", "prefill", "both")
    }
    assert slots == {"decode": 4096, "prefill": 64, "both": 64}
    torch = ["--runner", "torch", "--role", "decode", "--gpu-blocks"]
    assert parse_args([*torch, "4096"])[0].engine.num_staging_slots == TORCH_DECODE_STAGING
    assert parse_args([*torch, "512"])[0].engine.num_staging_slots == 512
    explicit = parse_args(["--role", "decode", "--staging-blocks", "8"])[0].engine
    assert explicit.num_staging_slots == 8


def test_invalid_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_main(["--gpu-blocks", "0"]) == 2
    assert "--gpu-blocks must be positive" in capsys.readouterr().err
    assert engine_main(["--external", "redis://x", "--external-dir", "/tmp/x"]) == 2
    assert engine_main(["stray"]) == 2


def test_kvrouter_dispatcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvrouter_main([]) == 2
    assert kvrouter_main(["--help"]) == 0 and "serve" in capsys.readouterr().out
    assert kvrouter_main(["bogus"]) == 2
    assert kvrouter_main(["engine", "--block-size", "0"]) == 2
    assert kvrouter_main(["up", "--workers", "0"]) == 2


def test_an_unknown_runner_option_fails_the_start() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "engine", "--port", "0", "--events", "none", "--bogus-knob", "1"],
        capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 1
    assert "unknown sim runner option 'bogus_knob'" in r.stdout + r.stderr


async def test_register_with_a_router_and_leave_on_sigterm() -> None:
    seen: list[tuple[str, str, dict | None, str | None]] = []

    async def workers(request: Request) -> JSONResponse:
        body = await request.json() if request.method == "POST" else None
        seen.append((request.method, request.url.path, body, request.headers.get("authorization")))
        return JSONResponse({"ok": True}, status_code=201 if body else 200)

    app = Starlette(routes=[
        Route("/workers", workers, methods=["POST"]),
        Route("/workers/{wid}", workers, methods=["DELETE"]),
    ])  # fmt: skip
    async with serve(app) as router:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "--port", "0", "--events", "tcp://127.0.0.1:0",
             "--replay", "tcp://127.0.0.1:0", "--register", router, "--worker-id", "e1",
             "--pool", "p1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env={**_env(), "KVROUTER_ADMIN_KEY": "sekret"},
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            ready = None
            for line in proc.stdout:
                ready = ENGINE_READY.search(line)
                if ready:
                    break
            assert ready is not None
            url, events, replay = ready.groups()
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
            await wait_for(lambda: len(seen) >= 1, 30, "registration")
            method, path, body, auth = seen[0]
            assert (method, path, auth) == ("POST", "/workers", "Bearer sekret")
            assert body == {
                "id": "e1", "url": url, "events_endpoint": events, "replay_endpoint": replay,
                "model": "kvrouter-sim", "pool": "p1",
            }  # fmt: skip
            proc.send_signal(signal.SIGTERM)
            await wait_for(lambda: len(seen) >= 2, 30, "deregistration")
            assert seen[1][:2] == ("DELETE", "/workers/e1")
            await wait_for(lambda: proc.poll() is not None, 30, "engine exit")
            # uvicorn re-raises the captured SIGTERM after its graceful shutdown
            assert proc.returncode in (0, -signal.SIGTERM)
            assert "Application shutdown complete" in proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
