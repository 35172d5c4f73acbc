"""``kvrouter up``: a router and N bundled engines on this machine, wired together.

Engines start first, each on free loopback ports (HTTP, events, replay) with a CPU_PINNED tier
and an EXTERNAL pool shared through one temporary directory (or ``--external redis://...``);
each prints its ready line with the bound addresses. Then the router starts with one ``--worker``
spec per engine (``pool=local``: EXTERNAL hits of one count for all). The router URL is printed
once it listens. Ctrl-C or SIGTERM stops everything; if any child dies, the rest are stopped too
and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

__all__ = ["ENGINE_READY", "ROUTER_READY", "main"]

ENGINE_READY = re.compile(r"kvrouter engine ready http=(\S+) events=(\S+) replay=(\S+)")
ROUTER_READY = re.compile(r"kvrouter router listening on (http://\S+)")


class UpError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    def pump(self) -> None:
        """Echo the child's output with its name, and keep it for the ready-line search."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
            sys.stderr.write(f"[{self.name}] {line}")
        self.lines.put("")

    def wait_line(
        self, pattern: re.Pattern[str], timeout: float, stop: threading.Event
    ) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UpError(f"{self.name} did not become ready within {timeout:.0f} s")
            if stop.is_set():
                raise UpError("interrupted")
            try:
                line = self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if line == "":
                raise UpError(
                    f"{self.name} exited with status {self.proc.wait()} before it was ready"
                )
            m = pattern.search(line)
            if m:
                return m


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter up",
        description="Start a router and N bundled engines on loopback; Ctrl-C stops them all.",
        allow_abbrev=False,
    )
    p.add_argument("--workers", type=int, default=2, help="number of engines (default 2)")
    p.add_argument("--runner", default="sim", choices=("sim", "torch"))
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8000, help="router port, 0 = any free port")
    p.add_argument("--model", help="engine --model (torch: HF dir or tiny-random[:...])")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=2048)
    p.add_argument("--cpu-blocks", type=int, default=1024)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument(
        "--external", help="EXTERNAL pool on Redis (redis://HOST:PORT/DB) instead of a dir"
    )
    p.add_argument("--external-dir", help="shared EXTERNAL directory (default: a temporary one)")
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every engine (repeatable), e.g. --engine-arg=--offload=write-back",
    )
    return p


def _child_env() -> dict[str, str]:
    # children import engine/router from the same tree as this kvrouter, installed or not
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _spawn(name: str, argv: list[str]) -> Child:
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        env=_child_env(),
    )
    child = Child(name, proc)
    threading.Thread(target=child.pump, name=f"pump-{name}", daemon=True).start()
    return child


def _stop(children: Sequence[Child], timeout: float = 10.0) -> None:
    for c in reversed(children):  # router first: it stops sending traffic
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.workers < 1:
        print("kvrouter up: --workers must be >= 1", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    tmp = Path(tempfile.mkdtemp(prefix="kvrouter-up-"))
    children: list[Child] = []
    try:
        return _run(args, tmp, children, stop)
    except UpError as exc:
        print(f"kvrouter up: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop(children)
        shutil.rmtree(tmp, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def _run(args: argparse.Namespace, tmp: Path, children: list[Child], stop: threading.Event) -> int:
    py = sys.executable
    shared = (
        ["--external", args.external]
        if args.external
        else ["--external-dir", args.external_dir or str(tmp / "external")]
    )
    specs = []
    for i in range(args.workers):
        name = f"engine-{i}"
        argv = [
            py, "-m", "engine", "--port", "0",
            "--events", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0",
            "--runner", args.runner, "--block-size", str(args.block_size),
            "--gpu-blocks", str(args.gpu_blocks), "--cpu-blocks", str(args.cpu_blocks),
            "--speedup", str(args.speedup), "--seed", str(i), *shared,
            *(["--model", args.model] if args.model else []), *args.engine_arg,
        ]  # fmt: skip
        children.append(_spawn(name, argv))
    for child in children:  # they start in parallel; collect their bound addresses
        url, events, replay = child.wait_line(ENGINE_READY, args.ready_timeout, stop).groups()
        spec = f"id={child.name},url={url},events={events},pool=local"
        specs.append(spec + (f",replay={replay}" if replay != "none" else ""))
    router_argv = [py, "-m", "router", "--host", args.host, "--port", str(args.port)]
    router_argv += ["--block-size", str(args.block_size)]
    for spec in specs:
        router_argv += ["--worker", spec]
    router = _spawn("router", router_argv)
    children.append(router)
    router_url = router.wait_line(ROUTER_READY, args.ready_timeout, stop).group(1)
    print(f"kvrouter up: router {router_url} with {args.workers} engines", flush=True)
    print(
        f"  try: curl {router_url}/v1/chat/completions -H 'Content-Type: application/json' "
        """-d '{"messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'""",
        flush=True,
    )
    while not stop.wait(0.2):
        for c in children:
            code = c.proc.poll()
            if code is not None:
                if stop.wait(0.5):  # Ctrl-C reached the children too: a normal stop
                    return 0
                print(f"kvrouter up: {c.name} exited with status {code}; stopping", file=sys.stderr)
                return 1
    return 0
