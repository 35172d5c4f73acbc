"""End to end: ``kvrouter up --workers 2`` as real subprocesses (two sim or two torch engines and
a router), and the official ``openai`` client holding a multi-turn chat through the router: turn 2
lands on turn 1's worker and is served from its cache."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.unit.engine.pd_helpers import gpu_stores
from tests.waiting import poll

ROOT = Path(__file__).resolve().parents[2]
BS = 16

pytestmark = pytest.mark.slow


def _command() -> list[str]:
    script = Path(sys.executable).with_name("kvrouter")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvrouter"]


# sim, and the torch runner with its default tiny random model on CPU (real KV, same contract)
RUNNERS = {"sim": ["--speedup", "10"], "torch": ["--runner", "torch", "--gpu-blocks", "512"]}


@pytest.fixture(params=sorted(RUNNERS))
def fleet(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [*_command(), "up", "--workers", "2", "--port", "0", *RUNNERS[request.param]],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT,
        start_new_session=True,  # its own process group: the teardown can reach every child
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            m = re.search(r"kvrouter up: router (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, f"kvrouter up did not start:\n{(tmp_path / 'up.log').read_text()}"

        def ready() -> bool:
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        poll(ready, 60, "router ready")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing should be left; make sure
        except ProcessLookupError:
            pass
        if proc.stdout is not None:
            proc.stdout.close()
        log.close()


def test_multi_turn_chat_stays_on_the_worker_that_holds_its_prefix(
    fleet: tuple[str, subprocess.Popen[str]],
) -> None:
    url, proc = fleet
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages: list[Any] = [
        {"role": "system", "content": "You are a terse assistant that answers in one line."},
        {"role": "user", "content": "Summarize why KV-aware routing beats round robin. " * 3},
    ]
    raw1 = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=24, temperature=0
    )
    turn1 = raw1.parse()
    worker = raw1.headers["x-kvrouter-worker"]
    assert turn1.usage is not None and turn1.choices[0].message.content
    assert worker in ("engine-0", "engine-1")

    messages += [
        {"role": "assistant", "content": turn1.choices[0].message.content},
        {"role": "user", "content": "And what does it cost?"},
    ]
    raw2 = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )
    turn2 = raw2.parse()
    client.close()
    assert raw2.headers["x-kvrouter-worker"] == worker
    assert turn2.usage is not None and turn2.usage.prompt_tokens_details is not None
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    # at least every full block of turn 1's prompt is reused on that worker
    assert cached is not None and cached >= turn1.usage.prompt_tokens // BS * BS > 0

    # Ctrl-C / SIGTERM stops the router and both engines
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    with pytest.raises(ProcessLookupError):  # signal 0 to the group: raises once it is empty
        poll(lambda: os.killpg(proc.pid, 0), 15, "every child gone")


def test_a_dying_engine_stops_the_whole_fleet(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [*_command(), "up", "--workers", "1", "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        engine_pid = router_up = None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            m = re.match(r"\[engine-0\] .*Started server process \[(\d+)\]", line)
            engine_pid = int(m.group(1)) if m else engine_pid
            router_up = router_up or "[router] kvrouter router listening on" in line
            if engine_pid and router_up:
                break
        assert engine_pid, "".join(lines)
        os.kill(engine_pid, signal.SIGKILL)
        assert proc.wait(30) == 1
        rest = proc.stderr.read()
        assert "engine-0 exited" in rest and "stopping" in rest
        with pytest.raises(ProcessLookupError):  # the router went down with it
            poll(lambda: os.killpg(proc.pid, 0), 15, "every child gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_port_in_use_fails_before_any_engine_in_one_line() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with socket.create_server(("127.0.0.1", 0)) as held:  # (8000, the default, is vLLM's too)
        port = held.getsockname()[1]
        done = subprocess.run(
            [*_command(), "up", "--port", str(port)],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
        )  # fmt: skip
    assert done.returncode == 5  # a ListenError's, as kvrouter serve's
    assert done.stderr.splitlines() == [  # no engine was started: no line of theirs
        f"kvrouter up: cannot listen on 127.0.0.1:{port}: the port is in use by another "
        "program: give another --port, or --port 0 for any free port"
    ]


def test_the_admin_key_file_reaches_the_router(tmp_path: Path) -> None:
    key = tmp_path / "admin.key"
    key.write_text("s3cret\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("KVROUTER_ADMIN_KEY", None)
    proc = subprocess.Popen(
        [*_command(), "up", "--workers", "1", "--port", "0", "--admin-key-file", str(key)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = next(
            m.group(1) for line in proc.stdout if (m := re.search(r"router (http://\S+)", line))
        )
        assert httpx.get(url + "/workers", timeout=10).status_code == 401
        got = httpx.get(url + "/workers", headers={"Authorization": "Bearer s3cret"}, timeout=10)
        assert got.status_code == 200 and "engine-0" in got.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # nothing should be left; make sure
            if proc.stdout is not None:
                proc.stdout.close()


def test_a_pd_fleet_serves_a_chat_through_a_real_kv_transfer(tmp_path: Path) -> None:
    """``kvrouter up --pd 1:2``: the router sends the prefill leg to the prefill engine and the
    decode leg to a decode engine, which pulls the blocks (its own events show them) and
    releases the prefill engine's lease."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*_command(), "up", "--pd", "1:2", "--pd-mode", "always", "--port", "0",
             "--speedup", "10"],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = next(
            (m.group(1) for line in proc.stdout if (m := re.search(r"router (http://\S+)", line))),
            None,
        )
        assert url, log_path.read_text()
        # the engines' ready lines, echoed before the router started
        engines = {
            m.group(1): (m.group(2), m.group(3))
            for m in re.finditer(
                r"\[(\S+)\] kvrouter engine ready http=(\S+) events=\S+ replay=(\S+)",
                log_path.read_text(),
            )
        }
        assert sorted(engines) == ["decode-0", "decode-1", "prefill-0"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages: Any = [{"role": "user", "content": "Why split prefill from decode? " * 4}]
        raw = client.chat.completions.with_raw_response.create(
            model="kvrouter-sim", messages=messages, max_tokens=8, temperature=0
        )
        client.close()
        answer = raw.parse()
        assert raw.headers["x-kvrouter-pd"] == "remote"
        assert raw.headers["x-kvrouter-prefill-worker"] == "prefill-0"
        decode = raw.headers["x-kvrouter-worker"]
        assert decode in ("decode-0", "decode-1") and answer.choices[0].message.content
        d_url, d_replay = engines[decode]
        ids = httpx.post(d_url + "/tokenize", json={"messages": messages}, timeout=10).json()
        ids = ids["tokens"]
        pulled = (len(ids) - 1) // BS
        side = httpx.get(d_url + "/debug/kv_transfers", timeout=10).json()
        assert side["pulls"] == {"pulled": 1, "failed": 0, "recomputed": 0}
        assert side["loaded_blocks"] == pulled > 0
        # BlockStored(GPU) for every pulled block, its tokens those of the prompt
        stored = gpu_stores(d_replay)
        assert stored[:pulled] == [ids[i * BS : (i + 1) * BS] for i in range(pulled)]
        p_side = httpx.get(engines["prefill-0"][0] + "/debug/kv_transfers", timeout=10).json()
        assert p_side["served"] == 1
        assert p_side["leases"]["held"] == 0 and p_side["leases"]["ended"]["pulled"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()
