"""``kvrouter serve`` / ``python -m router``: parse flags, load settings, run the app with uvicorn.

``main(argv)`` takes the words after ``serve`` (``kvrouter serve --port 0`` calls
``main(["--port", "0"])``). Once the socket is bound it prints
``kvrouter router listening on http://HOST:PORT`` (with the real port when ``--port 0``) — the
``kvrouter up`` launcher reads that line. With ``--processes N`` (``server.processes``) it
supervises N router processes on one port instead (:mod:`router.edge.processes`); each of them
is this same ``main`` on the inherited socket (``--fd``), and prints
``kvrouter router process I (pid P) listening on ...``. With the endpoint picker on
(``epp.port``), a second line ``kvrouter EPP listening on HOST:PORT`` follows.

The listening socket is bound before the app starts. A failure at start that the router knows
(a :class:`router.errors.RouterError`: a setting, a worker, the address) is one line on stderr
and the exit status of its kind (``exit_code``); the lifespan's are kept in the app's
``state.startup_error`` and reach here without uvicorn's traceback of them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

import msgspec
import uvicorn

from router.edge.processes import process_settings, run_processes
from router.edge.server import RouterServer, bind_listener, server_config
from router.errors import ConfigError, ListenError, RouterError, WorkerUnusable
from router.settings import ENV_PREFIX, Settings, load_settings

__all__ = ["build_parser", "main", "settings_from_args"]

log = logging.getLogger("kvrouter.cli")


def _epilog() -> str:
    e = ENV_PREFIX
    return f"""\
Envoy endpoint picker (EPP): with epp.port set (config, or {e}EPP__PORT)
the router also serves Envoy's ext_proc gRPC there, picking the worker for
each request of an Envoy or a Gateway API InferencePool in front of the
fleet. It needs the epp extra (pip install -e '.[epp]'); docs/deploy.md.

Environment: any setting as {e}<KEY>, nested keys joined by __; it
overrides the config file and flags override it. {e}CONFIG=FILE (the
config), {e}PORT=9000, {e}SCORING__OVERLAP_WEIGHT=2,
{e}ADMIN_KEY (the key /workers needs: unlike --admin-key, out of
ps), {e}ADMIN_KEY_FILE, {e}API_KEYS_FILE. All: docs/configuration.md.

Exit status at start: {ConfigError.exit_code} a setting, {WorkerUnusable.exit_code} a worker that cannot be set up,
{ListenError.exit_code} an address that cannot be listened on (one line on stderr says which).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter serve",
        description="KV-aware router: /route placement API and OpenAI proxy over a worker fleet.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="router YAML config (see configs/router.example.yaml)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port, 0 = any free port (default 8000)")
    p.add_argument("--block-size", type=int, help="router block size in tokens (default 16)")
    p.add_argument(
        "--admin-key",
        help="bearer key required by /workers; visible to every local user in ps: prefer "
        "KVROUTER_ADMIN_KEY or --admin-key-file",
    )
    p.add_argument("--admin-key-file", help="file holding the admin key (a mounted Secret)")
    p.add_argument("--api-keys-file", help="file of client keys, one a line (# comments)")
    p.add_argument("--tokenizer", help="byte | hf:<dir> | worker (default byte)")
    p.add_argument("--log-level", help="critical|error|warning|info|debug (default info)")
    p.add_argument("--log-format", choices=("text", "json"), help="log lines (default text)")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="SPEC",
        help="id=w0,url=http://127.0.0.1:8001,events=tcp://127.0.0.1:5557"
        "[,replay=tcp://127.0.0.1:5558][,dp=2][,pool=P][,model=M]"
        "[,role=prefill|decode|both][,bootstrap=PORT] (repeatable); without events=, "
        "the worker's GET /kv_event_sources (vLLM) says them",
    )
    p.add_argument("--processes", type=int, help="router processes on one port, synced (default 1)")
    p.add_argument(
        "--warm-from",
        action="append",
        default=[],
        metavar="URL",
        help="a peer router whose index to start from (tried before replicas.warm_from)",
    )
    # --processes' own: the inherited listening socket (not --host/--port), "I/N", and the
    # directory of their sync endpoints; internal, so out of --help
    p.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--process", help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", help=argparse.SUPPRESS)
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "block_size": args.block_size,
        "admin_key": args.admin_key,
        "admin_key_file": args.admin_key_file,
        "api_keys_file": args.api_keys_file,
        "tokenizer": args.tokenizer,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }
    if args.processes is not None:
        overrides["server"] = {"processes": args.processes}
    settings = load_settings(args.config, overrides=overrides, worker_specs=args.worker)
    if args.warm_from:
        warm = [*args.warm_from, *settings.replicas.warm_from]
        replicas = msgspec.structs.replace(settings.replicas, warm_from=warm)
        settings = msgspec.structs.replace(settings, replicas=replicas)
    return settings


class _KnownStartupFailure(logging.Filter):
    """Drops uvicorn's "Application startup failed. Exiting." when the app knows why
    (``state.startup_error``): :func:`main` says that in one line instead."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self._state = state

    def filter(self, record: logging.LogRecord) -> bool:
        known = getattr(self._state, "startup_error", None) is not None
        return not (known and record.getMessage().startswith("Application startup failed"))


class _Server(RouterServer):
    """The router's server (uvicorn's, with the head deadline), plus the router's drain: the
    first SIGTERM turns ``/ready`` to 503 at once and keeps the listener serving until no proxied
    request is in flight, at most ``server.drain_grace_s``; then uvicorn's own graceful
    shutdown. A second signal stops now."""

    def __init__(
        self, config: uvicorn.Config, app: Any, grace_s: float, process: int | None = None
    ) -> None:
        super().__init__(config)
        self._app = app
        self._grace_s = grace_s
        self._process = process

    def handle_exit(self, sig: int, frame: Any) -> None:
        kv = getattr(self._app.state, "kv", None)
        if sig != signal.SIGTERM or kv is None or kv.draining or self._grace_s <= 0:
            super().handle_exit(sig, frame)
            return
        kv.draining = True
        log.info("SIGTERM: draining (/ready 503) for at most %.0f s", self._grace_s)
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(kv)))

    async def _drain(self, kv: Any) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._grace_s
        while kv.placer.inflight > 0 and loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)  # polling the in-flight count: no event exists for it
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        quiet = _KnownStartupFailure(self._app.state)
        logging.getLogger("uvicorn.error").addFilter(quiet)
        try:
            await super().startup(sockets)
        except SystemExit:  # uvicorn's on a failed lifespan: the reason, if the app knows it
            failed = getattr(self._app.state, "startup_error", None)
            if failed is None:
                raise
            raise failed from failed.__cause__  # main prints it
        finally:
            logging.getLogger("uvicorn.error").removeFilter(quiet)
        if not self.started:
            return
        urls = []
        for server in getattr(self, "servers", []):
            for sock in server.sockets or ():
                host, port = sock.getsockname()[:2]
                urls.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
                break
        if not urls:
            urls.append(f"http://{self.config.host}:{self.config.port}")
        if self._process is None:
            print(f"kvrouter router listening on {urls[0]}", flush=True)
        else:  # (router.edge.processes reads it; the second URL is this process's own port)
            who = f"kvrouter router process {self._process} (pid {os.getpid()})"
            print(f"{who} listening on {' and '.join(urls)}", flush=True)
        epp_port = getattr(self._app.state, "epp_port", None)
        if epp_port is not None:  # (the real port when epp.port is 0, at any --log-level)
            host = self._app.state.settings.epp.host
            host = f"[{host}]" if ":" in host else host
            print(f"kvrouter EPP listening on {host}:{epp_port}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return _serve(argv, args)
    except RouterError as e:  # a start-up failure the router knows: one line, its own status
        print(f"kvrouter: {e}", file=sys.stderr)
        return e.exit_code


def _serve(argv: list[str], args: argparse.Namespace) -> int:
    process: int | None = None
    settings = settings_from_args(args)
    if args.process is not None:
        settings, process = process_settings(settings, args.process, args.sync_dir or "")
    _logging(settings, args, process)
    if settings.server.processes > 1:
        return run_processes(argv, settings)
    if args.fd is not None:  # inherited, already listening (router.edge.processes)
        sockets = [socket.socket(fileno=args.fd)]
        port = settings.server.metrics_port
        if process is not None and port is not None:  # this process's own port besides
            port = port + process if port else 0
            sockets.append(bind_listener(settings.host, port, "server.metrics_port"))
    else:  # bound first: a port in use fails here, before the app subscribes to any worker
        sockets = [bind_listener(settings.host, settings.port)]
    from router.edge.app import create_app

    app = create_app(settings, process=process or 0)
    # (raises the soft RLIMIT_NOFILE; fails when it leaves no room for clients)
    # log_config None: uvicorn's own lines go through the root handler too, with its format
    # (JSON, the process tag) instead of uvicorn's
    config = server_config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None
    )
    server = _Server(config, app, settings.server.drain_grace_s, process)
    try:
        _run(server.serve(sockets))
    except KeyboardInterrupt:
        pass
    finally:
        for sock in sockets:
            sock.close()
    return 0 if server.started else 1


def _logging(settings: Settings, args: argparse.Namespace, process: int | None) -> None:
    """The root handler's format; ``process``: ``--processes``' index of this one, which tags
    its lines (``[p1]``; JSON: ``"process": 1``), as they share one stderr."""
    tag = "" if process is None else f"[p{process}] "
    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s",
    )
    if settings.log_format == "json":
        from router.edge.access import JsonFormatter

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter(process))
    if args.admin_key:
        log.warning(
            "--admin-key is visible to every local user in ps: give the admin key in "
            "KVROUTER_ADMIN_KEY or a file (--admin-key-file, admin_key_file) instead"
        )
    # httpx logs every health check at INFO: keep it for debugging only
    if settings.log_level not in ("debug", "trace"):
        logging.getLogger("httpx").setLevel(logging.WARNING)


def _run(main: Coroutine[Any, Any, None]) -> None:
    """On uvloop where installed: its loop costs about 60 µs less per request than asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
