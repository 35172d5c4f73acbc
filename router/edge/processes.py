"""``kvrouter serve --processes N`` (``server.processes``): N router replica processes on one
listening port, so a router uses more than one core of its machine. Each process is a whole
router — ``kvrouter serve`` itself, through :mod:`router.edge.server`'s serving path — with its
own index from the workers' events, and the processes place as one through replica sync
(:mod:`router.runtime.replicas`) over ``ipc://`` endpoints in a private directory (0700) this
parent makes and removes. What this parent does, and why:

- **One socket, bound here and inherited** (``kvrouter serve --fd``), not ``SO_REUSEPORT``: one
  accept queue, so a connection waiting in it is taken by another process when one dies (with
  ``SO_REUSEPORT`` each process has its own queue, reset with its socket), no other program can
  bind the port beside them, ``--port 0`` names one port, and a process busy placing takes fewer
  new connections than an idle one (it is away from its accept loop). Spreading is not even:
  each keep-alive connection stays with the process that accepted it.
- **Supervision**: a process that dies is started again (1 s, doubling to 30 s between tries,
  reset once one has served for a minute), as gunicorn and uvicorn restart their workers; a
  restarted process warm-starts from a sibling's index through the shared port when the admin
  key is set. When processes fail :data:`MAX_EARLY_FAILURES` times in a row before serving
  (a port, a worker or a file that cannot be had), the router stops, exiting 1: restarting would
  not help, and an orchestrator should see it.
- **Signals**: SIGTERM and SIGINT are forwarded to every process (each drains as a single router
  does: ``/ready`` 503, in-flight requests finish); the parent exits once they all have. The
  processes run in their own session, so a terminal's Ctrl-C reaches them once, through here, and
  on Linux they are sent SIGTERM if this parent dies.
- **One endpoint picker**: with ``epp.port`` set, process 0 alone serves it (a gRPC port is
  never shared); its placements reach the other processes by sync, like theirs reach it.
- **Metrics are per process**: ``/metrics`` on the shared port answers from whichever process
  took the connection (``kvrouter_replica_info{process}`` says which); ``server.metrics_port``
  gives process ``i`` a port of its own besides (``metrics_port + i``; 0: any free port, named on
  its line), to scrape each. Aggregating in one process was left out: prometheus_client's
  multiprocess mode does not take the router's own collectors. Prometheus scrapes each process's
  port (deploy/observability/prometheus.yml), never the shared one.
- **Logs**: the processes share stderr; each tags its lines ``[pI]`` (JSON: ``"process": I``;
  router.cli), the parent's own lines are untagged.

stdout carries each process's ``kvrouter router process I (pid P) listening on ...`` line and,
once the first process serves, the usual ``kvrouter router listening on http://HOST:PORT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence

import msgspec

from indexer.hosts import is_wildcard
from router.edge.server import bind_listener
from router.errors import ConfigError
from router.settings import Settings

__all__ = [
    "MAX_EARLY_FAILURES",
    "Supervisor",
    "local_url",
    "process_settings",
    "run_processes",
]

log = logging.getLogger("kvrouter.processes")

#: processes in a row that exit before serving: the router stops
MAX_EARLY_FAILURES = 3
_BACKOFF_S, _BACKOFF_MAX_S, _SETTLED_S = 1.0, 30.0, 60.0
_PR_SET_PDEATHSIG = 1


def local_url(sock: socket.socket) -> str:
    """How this machine reaches the socket (a wildcard address as loopback)."""
    host, port = sock.getsockname()[:2]
    if is_wildcard(host):
        host = "::1" if ":" in host else "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def process_settings(settings: Settings, process: str, sync_dir: str) -> tuple[Settings, int]:
    """Process ``I/N``'s settings: one process, publishing on ``ipc://DIR/I.sock`` and
    subscribed to its siblings' (and to ``replicas.peers``); ``snapshot.path`` is process 0's
    alone (one writer per file), and so is the endpoint picker (``epp.port``). Returns them and
    ``I``."""
    try:
        i, n = (int(x) for x in process.split("/"))
    except ValueError as e:
        raise ConfigError(f"--process {process!r}: not I/N") from e
    if not (0 <= i < n and sync_dir):
        raise ConfigError(f"--process {process!r} needs 0 <= I < N and --sync-dir")
    eps = [f"ipc://{sync_dir}/{j}.sock" for j in range(n)]
    rs = settings.replicas
    peers = [*rs.peers, *(ep for j, ep in enumerate(eps) if j != i)]
    replicas = msgspec.structs.replace(rs, sync_bind=eps[i], peers=peers)
    server = msgspec.structs.replace(settings.server, processes=1)
    snapshot, epp = settings.snapshot, settings.epp
    if i > 0:  # the others start from the workers' replays, or restarted, from a sibling
        snapshot = msgspec.structs.replace(snapshot, path=None)
        # one endpoint picker, process 0's: its port is never shared (grpc.so_reuseport off),
        # and its placements reach the siblings by sync like any other
        epp = msgspec.structs.replace(epp, port=None)
    got = msgspec.structs.replace(
        settings, replicas=replicas, server=server, snapshot=snapshot, epp=epp
    )
    return got, i


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """In the child, before exec: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    """Runs and keeps ``n`` processes of ``kvrouter serve <argv>`` on ``sock``."""

    def __init__(self, argv: Sequence[str], settings: Settings, sock: socket.socket) -> None:
        self.argv = list(argv)
        self.n = settings.server.processes
        self.sock = sock
        self.url = local_url(sock)  # (a restarted process's warm start)
        name = sock.getsockname()
        host = f"[{name[0]}]" if ":" in name[0] else name[0]
        self.line = f"kvrouter router listening on http://{host}:{name[1]}\n".encode()
        self.stopping = False
        self.failed = False
        self.announced = False
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.sync_dir = ""
        self._stop = asyncio.Event()

    def command(self, i: int, restart: bool) -> list[str]:
        cmd = [sys.executable, "-m", "router", *self.argv]
        cmd += ["--fd", str(self.sock.fileno()), "--process", f"{i}/{self.n}"]
        cmd += ["--sync-dir", self.sync_dir]
        if restart:  # its siblings answer on the shared port meanwhile
            cmd += ["--warm-from", self.url]
        return cmd

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.forward, sig)
        self.sync_dir = tempfile.mkdtemp(prefix="kvrouter-sync-")  # (mode 0700)
        try:
            log.info("router on %s: %d processes, synced in %s", self.url, self.n, self.sync_dir)
            await asyncio.gather(*(self.keep(i) for i in range(self.n)))
        finally:
            shutil.rmtree(self.sync_dir, ignore_errors=True)
        return 1 if self.failed else 0

    def forward(self, sig: int) -> None:
        """SIGTERM / SIGINT: to every process; no more restarts."""
        if not self.stopping:
            log.info("%s: stopping the router's %d processes", signal.Signals(sig).name, self.n)
        self.stopping = True
        self._stop.set()
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    async def keep(self, i: int) -> None:
        """Process ``i``, started again whenever it dies, until the router stops."""
        backoff, early, restart = _BACKOFF_S, 0, False
        while not self.stopping:
            t0 = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *self.command(i, restart),
                stdout=asyncio.subprocess.PIPE,
                pass_fds=(self.sock.fileno(),),
                start_new_session=True,  # signals reach it through forward(), once
                preexec_fn=_die_with_parent,
            )
            self.procs[i] = proc
            served = await self.relay(proc)
            rc = await proc.wait()
            if self.stopping:
                return
            early = 0 if served else early + 1
            if early >= MAX_EARLY_FAILURES:
                log.error(
                    "router process %d exited %d times in a row before serving (last: %s): "
                    "stopping",
                    i,
                    early,
                    rc,
                )
                self.failed = True
                self.forward(signal.SIGTERM)
                return
            if time.monotonic() - t0 > _SETTLED_S:
                backoff = _BACKOFF_S
            log.error(
                "router process %d (pid %d) exited with %s: starting it again in %.0f s",
                i,
                proc.pid,
                rc,
                backoff,
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), backoff)
            backoff = min(2 * backoff, _BACKOFF_MAX_S)
            restart = True

    async def relay(self, proc: asyncio.subprocess.Process) -> bool:
        """Copy the process's stdout to ours until it closes; whether it ever served."""
        assert proc.stdout is not None
        served = False
        async for line in proc.stdout:
            sys.stdout.buffer.write(line)
            if line.startswith(b"kvrouter router process "):
                served = True
                if not self.announced:
                    self.announced = True
                    sys.stdout.buffer.write(self.line)
            sys.stdout.flush()
        return served


def run_processes(argv: Sequence[str], settings: Settings) -> int:
    """``kvrouter serve`` with ``server.processes`` > 1: the exit status."""
    sock = bind_listener(settings.host, settings.port)  # (ListenError: the caller says it)
    try:
        return asyncio.run(Supervisor(argv, settings, sock).run())
    finally:
        sock.close()
