"""Real router processes for the replica tests: ``python -m router serve`` with a YAML config, on
port 0 (the bound URL read back from its stdout line), its log in a file; its ``/metrics`` read
back as numbers; and :func:`until`, which waits for an async condition (an HTTP answer) with a
timeout, never a sleep for a state to arrive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[4]
LINE = re.compile(rb"kvrouter router listening on (http://127\.0\.0\.1:\d+)")
PROCESS_LINE = re.compile(
    rb"kvrouter router process (\d+) \(pid (\d+)\) listening on (http://\S+)(?: and (http://\S+))?"
)
ADMIN = {"authorization": "Bearer admin-key"}


async def until(cond: Callable[[], Awaitable[Any]], timeout: float = 30.0, what: str = "") -> Any:
    """Await ``cond()`` every 20 ms until it returns something truthy (returned); fail after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = await cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        await asyncio.sleep(0.02)


class RouterProc:
    """One ``kvrouter serve`` process (or a ``--processes`` parent)."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc = proc
        self.log_path = log
        self.url = ""
        #: with --processes: index -> (pid, url of its own port or None), the latest of each
        self.processes: dict[int, tuple[int, str | None]] = {}
        self.lines: list[bytes] = []  # stdout
        self._drain: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls, tmp: Path, name: str, config: dict[str, Any], *args: str, processes: int = 0
    ) -> RouterProc:
        cfg = tmp / f"{name}.yaml"
        config = {"admin_key": "admin-key", "health": {"interval_s": 0.2}, **config}
        cfg.write_text(yaml.safe_dump(config))
        log = tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
        env["PYTHONPATH"] = str(ROOT)
        with open(log, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router", "serve", "--config", str(cfg), "--port", "0",
                *args, stdout=asyncio.subprocess.PIPE, stderr=err, cwd=str(ROOT), env=env,
            )  # fmt: skip
        r = cls(proc, log)
        try:
            await asyncio.wait_for(r._read_lines(processes), 60)
        except BaseException:
            await r.stop()
            raise AssertionError(f"router {name} did not start:\n{r.log()[-3000:]}") from None
        r._drain = asyncio.create_task(r._drain_stdout())
        return r

    async def _read_lines(self, processes: int) -> None:
        assert self.proc.stdout is not None
        while not self.url or len(self.processes) < processes:
            line = await self.proc.stdout.readline()
            if not line:
                raise EOFError("stdout closed")
            self._parse(line)

    def _parse(self, line: bytes) -> None:
        self.lines.append(line)
        m = LINE.search(line)
        if m:
            self.url = m.group(1).decode()
        p = PROCESS_LINE.search(line)
        if p:
            own = p.group(4).decode() if p.group(4) else None
            self.processes[int(p.group(1))] = (int(p.group(2)), own)

    async def _drain_stdout(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self._parse(line)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), 40)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
        return self.proc.returncode


async def metrics(http: httpx.AsyncClient, url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of a router's ``/metrics``."""
    text = (await http.get(url + "/metrics")).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def metric(http: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    return (await metrics(http, url)).get((name, tuple(sorted(labels.items()))), 0.0)


async def route(http: httpx.AsyncClient, url: str, tokens: list[int], **extra: Any) -> dict:
    resp = await http.post(url + "/route", json={"token_ids": tokens, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def candidate(answer: dict, worker: str) -> dict:
    (c,) = [c for c in answer["candidates"] if c["worker_id"] == worker]
    return c  # type: ignore[no-any-return]


async def ready(http: httpx.AsyncClient, url: str) -> bool:
    return (await http.get(url + "/ready")).status_code == 200
