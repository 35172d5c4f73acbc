"""``kvrouter serve`` failing at start after its settings were checked, as a real process: each
failure is one line on stderr that names what is wrong and what to do (no traceback), with an
exit status of its own (router.errors: 2 a setting, 4 a worker, 5 the listening address)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


async def _serve(*args: str) -> tuple[int, list[str]]:
    """Run ``kvrouter serve ARGS`` (warnings and worse logged) to its end: its status and
    stderr lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", "serve", "--log-level", "warning", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT),
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except asyncio.TimeoutError:  # it started after all: never leave it running
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    assert b"listening on" not in out
    return proc.returncode, err.decode().splitlines()


async def test_a_tokenizer_directory_without_tokenizer_json_is_one_line_exit_2(tmp_path):
    code, err = await _serve("--port", "0", "--tokenizer", f"hf:{tmp_path}")
    assert code == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("kvrouter: invalid config: tokenizer: cannot load ")
    assert f"{tmp_path}/tokenizer.json" in err[0] and "'worker'" in err[0]


async def test_an_unreachable_worker_without_events_is_one_line_exit_4():
    # no events= given and nothing listens at the URL: /kv_event_sources cannot say (a worker
    # that answers 404 there joins on its approximate tree instead: test_router_approximate)
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # (closed again: connections to it are refused)
    code, err = await _serve("--port", "0", "--worker", f"id=w0,url=http://127.0.0.1:{port}")
    assert code == 4, err
    assert len(err) == 1, err
    assert err[0].startswith("kvrouter: worker 'w0': GET ")
    assert "/kv_event_sources failed" in err[0] and "give events=tcp://" in err[0]
    assert "events=none" in err[0]


async def test_a_port_in_use_is_one_line_exit_5_with_one_process_or_more():
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        for processes in ("1", "2"):
            code, err = await _serve("--port", str(port), "--processes", processes)
            assert code == 5, err
            assert err == [
                f"kvrouter: cannot listen on 127.0.0.1:{port}: the port is in use by another "
                "program: give another --port, or --port 0 for any free port"
            ]
