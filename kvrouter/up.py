"""``kvrouter up``: a router and N bundled engines on this machine, wired together.

The router's port is tried first: one in use fails at once, in one line, exit status 5
(:class:`router.errors.ListenError`'s). Engines start then, each on free loopback ports (HTTP, events, replay) with a CPU_PINNED tier
and an EXTERNAL pool shared through one temporary directory (or ``--external redis://...``);
each prints its ready line with the bound addresses. Then the router starts with one ``--worker``
spec per engine (``pool=local``: EXTERNAL hits of one count for all). ``--pd P:D`` starts P
engines ``--role prefill`` and D ``--role decode`` instead, each spec with its ``role=``: the
router splits requests between them over vLLM's NIXL exchange, which the engines speak. The router URL is printed
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
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import httpx

from router.errors import ListenError
from router.settings import PD_MODES, PdSettings

__all__ = [
    "ENGINE_READY",
    "ROUTER_READY",
    "Child",
    "UpError",
    "engine_argv",
    "main",
    "router_argv",
    "spawn",
    "stop_children",
    "worker_spec",
]

ENGINE_READY = re.compile(r"kvrouter engine ready http=(\S+) events=(\S+) replay=(\S+)")
ROUTER_READY = re.compile(r"kvrouter router listening on (http://\S+)")
#: each process of ``kvrouter serve --processes N`` prints this once it serves (router.cli)
PROCESS_READY = re.compile(r"kvrouter router process \d+ \(pid \d+\) listening on ")


class UpError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    #: where the child's output is echoed, prefixed with its name (None: this process's stderr)
    log: TextIO | None = None
    pumping: threading.Thread | None = None

    def pump(self) -> None:
        """Echo the child's output with its name, and keep it for the ready-line search."""
        assert self.proc.stdout is not None
        with self.proc.stdout:  # closed at EOF: the child is gone
            for line in self.proc.stdout:
                self.lines.put(line)
                (self.log or sys.stderr).write(f"[{self.name}] {line}")
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


def answers_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether ``GET url`` answers 200 now (any HTTP error: no)."""
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something true (returned); :class:`UpError` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise UpError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter up",
        description="Start a router and N bundled engines on loopback; Ctrl-C stops them all.",
        allow_abbrev=False,
    )
    p.add_argument("--workers", type=int, default=2, help="number of engines (default 2)")
    p.add_argument(
        "--pd",
        metavar="P:D",
        type=_pd_ratio,
        help="a prefill/decode fleet instead: P engines --role prefill, D --role decode, each "
        "known to the router by its role (vLLM's NIXL exchange; replaces --workers)",
    )
    p.add_argument(
        "--pd-mode",
        choices=PD_MODES,
        help=f"the router's pd.mode (default: its own setting, {PdSettings().mode})",
    )
    p.add_argument(
        "--runner",
        default="sim",
        choices=("sim", "torch"),
        help="sim: simulated timing, no model (default); torch: a real model on this machine",
    )
    p.add_argument("--host", default="127.0.0.1", help="router bind address (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="router port (default 8000, vLLM's default too), 0 = any free port",
    )
    p.add_argument("--model", help="engine --model (torch: HF dir or tiny-random[:...])")
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block, router and engines (16)"
    )
    p.add_argument(
        "--gpu-blocks", type=int, default=2048, help="GPU tier per engine, in blocks (2048)"
    )
    p.add_argument(
        "--cpu-blocks", type=int, default=1024, help="CPU_PINNED tier per engine, in blocks (1024)"
    )
    p.add_argument(
        "--speedup", type=float, default=1.0, help="sim: divide every simulated delay by this (1)"
    )
    p.add_argument(
        "--external", help="EXTERNAL pool on Redis (redis://HOST:PORT/DB) instead of a dir"
    )
    p.add_argument("--external-dir", help="shared EXTERNAL directory (default: a temporary one)")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds each engine and the router get to start (default 120)",
    )
    p.add_argument(
        "--admin-key-file",
        metavar="PATH",
        help="the router's admin key (for /workers) from this file; or KVROUTER_ADMIN_KEY in the "
        "environment, which the router inherits",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every engine (repeatable), e.g. --engine-arg=--offload=write-back",
    )
    return p


def _pd_ratio(value: str) -> tuple[int, int]:
    p, sep, d = value.partition(":")
    if not (sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
        raise argparse.ArgumentTypeError(f"--pd takes P:D, two counts >= 1 (got {value!r})")
    return int(p), int(d)


def _child_env() -> dict[str, str]:
    # children import engine/router from the same tree as this kvrouter, installed or not
    env = dict(os.environ)
    # kvrouter.gateway's (the Envoy binary): no router setting, and a router refuses an unknown
    # KVROUTER_* variable
    env.pop("KVROUTER_ENVOY_BIN", None)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def engine_argv(
    seed: int,
    *,
    runner: str = "sim",
    block_size: int = 16,
    gpu_blocks: int = 2048,
    cpu_blocks: int = 0,
    speedup: float = 1.0,
    extra: Sequence[str] = (),
) -> list[str]:
    """One bundled engine on free loopback ports (HTTP, events, replay); it prints ENGINE_READY."""
    return [
        sys.executable, "-m", "engine", "--port", "0",
        "--events", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0",
        "--runner", runner, "--block-size", str(block_size),
        "--gpu-blocks", str(gpu_blocks), "--cpu-blocks", str(cpu_blocks),
        "--speedup", str(speedup), "--seed", str(seed), *extra,
    ]  # fmt: skip


def worker_spec(
    name: str, ready: re.Match[str], pool: str | None = None, role: str | None = None
) -> str:
    """The router's ``--worker`` spec for an engine, from its ENGINE_READY line."""
    url, events, replay = ready.groups()
    spec = f"id={name},url={url},events={events}" + (f",pool={pool}" if pool else "")
    spec += f",role={role}" if role else ""
    return spec + (f",replay={replay}" if replay != "none" else "")


def router_argv(
    specs: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    block_size: int = 16,
    admin_key_file: str | None = None,
) -> list[str]:
    """The router in front of those workers; it prints ROUTER_READY with its bound URL."""
    argv = [sys.executable, "-m", "router", "--host", host, "--port", str(port)]
    argv += ["--block-size", str(block_size)]
    if admin_key_file is not None:
        argv += ["--admin-key-file", admin_key_file]
    for spec in specs:
        argv += ["--worker", spec]
    return argv


def spawn(
    name: str, argv: list[str], log: TextIO | None = None, env: dict[str, str] | None = None
) -> Child:
    """Start a child with this tree on its PYTHONPATH (plus ``env``); its output is pumped."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        env={**_child_env(), **(env or {})},
    )
    child = Child(name, proc, log=log)
    child.pumping = threading.Thread(target=child.pump, name=f"pump-{name}", daemon=True)
    child.pumping.start()
    return child


def stop_children(children: Sequence[Child], timeout: float = 10.0) -> None:
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
    for c in children:  # their last lines are echoed before the caller closes its log
        if c.pumping is not None:
            c.pumping.join(5.0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.workers < 1:
        print("kvrouter up: --workers must be >= 1", file=sys.stderr)
        return 2
    try:  # the router's port, before any engine starts: one in use fails now, in one line
        _probe_listen(args.host, args.port)
    except ListenError as e:
        print(f"kvrouter up: {e}", file=sys.stderr)
        return e.exit_code
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
        stop_children(children)
        shutil.rmtree(tmp, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def _probe_listen(host: str, port: int) -> None:
    """:class:`ListenError` unless the router could listen on ``host:port`` now (the router binds
    it itself: router.edge.server.bind_listener, which the replay's import contract keeps out of
    this module)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as e:
        raise ListenError.binding(host, port, e) from e


def _run(args: argparse.Namespace, tmp: Path, children: list[Child], stop: threading.Event) -> int:
    shared = (
        ["--external", args.external]
        if args.external
        else ["--external-dir", args.external_dir or str(tmp / "external")]
    )
    extra = [*shared, *(["--model", args.model] if args.model else []), *args.engine_arg]
    # a PD fleet: P prefill engines (prefill-0...), then D decode engines (decode-0...)
    roles = ["prefill"] * args.pd[0] + ["decode"] * args.pd[1] if args.pd else []
    names = [f"{r}-{roles[:i].count(r)}" for i, r in enumerate(roles)] or [
        f"engine-{i}" for i in range(args.workers)
    ]
    for i, name in enumerate(names):
        argv = engine_argv(
            i,
            runner=args.runner,
            block_size=args.block_size,
            gpu_blocks=args.gpu_blocks,
            cpu_blocks=args.cpu_blocks,
            speedup=args.speedup,
            extra=[*extra, *(["--role", roles[i]] if roles else [])],
        )
        children.append(spawn(name, argv))
    specs = [  # they start in parallel; collect their bound addresses
        worker_spec(
            c.name,
            c.wait_line(ENGINE_READY, args.ready_timeout, stop),
            pool="local",
            role=roles[i] if roles else None,
        )
        for i, c in enumerate(children)
    ]
    router_cmd = router_argv(
        specs,
        host=args.host,
        port=args.port,
        block_size=args.block_size,
        admin_key_file=args.admin_key_file,
    )
    env = {"KVROUTER_PD__MODE": args.pd_mode} if args.pd_mode else None
    router = spawn("router", router_cmd, env=env)
    children.append(router)
    router_url = router.wait_line(ROUTER_READY, args.ready_timeout, stop).group(1)
    fleet = f"{args.pd[0]} prefill + {args.pd[1]} decode" if args.pd else str(args.workers)
    print(f"kvrouter up: router {router_url} with {fleet} engines", flush=True)
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
