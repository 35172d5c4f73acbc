"""Live replay's servers: a fresh fleet of bundled engines per policy, the router in front of it
(kvrouter, or sglang-router or smg from their own Pythons), their readiness, CPU time and counters.

A :class:`Fleet` starts N sim engines on free loopback ports (the ``kvrouter up`` building blocks
of :mod:`kvrouter.up`, GPU tier only unless engine arguments say otherwise, so every policy sees
the same cache size), then at most one router: ``kvrouter`` (``python -m router`` with one
``--worker`` spec per engine, optionally ``--config``) or ``sglang`` (``PYTHON -m
sglang_router.launch_router --worker-urls ... --policy cache_aware``; a Python with the
``sglang-router`` package, never a dependency of this project) or ``smg`` (``PYTHON -m
smg.launch_router``, the same arguments: SGLang's gateway since, PyPI ``smg``; the engines all
serve one model name, which it routes by). For policy ``kvrouter-epp`` the
router runs its endpoint picker on a free port and a real Envoy (:mod:`kvrouter.gateway`) in front
of it is what clients call (:meth:`Fleet.start_gateway`). Closing stops them all.

Mixed fleets and faults (issue 36), for kvrouter alone (the peers subscribe to no events): the
first ``no_events`` engines are ``events=none`` workers of the router (they still run; it keeps
their approximate trees), and an engine with a fault in :attr:`FleetSpec.faults` (the last K of
each, as in virtual time) reaches the router through a :class:`kvrouter.replay.relay.EventRelay`
that spoils its events with no sequence gap (:func:`kvrouter.replay.relay.relayed_specs`, not here:
the virtual replay imports this module, and no zmq); the router still asks the engine's own replay
endpoint for a fresh stream (not a reseeded one's: that would heal what the fault models, so it
has none and rebuilds from its live events). ``faults.loop`` off sets
``KVROUTER_AGREEMENT__ENABLED=false``. A silent restart (:meth:`Fleet.schedule_restart`) is real
for every policy: ``POST /reset_prefix_cache`` on those engines mid-run, their
``AllBlocksCleared`` swallowed by the relay.

CPU time is read from ``/proc/<pid>/stat`` (utime + stime of the process and its live
descendants), so no psutil; on a system without ``/proc`` it is reported as unknown.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.gateway import EPP_ENV, EPP_READY, EnvoyProcess, load, render
from kvrouter.replay.faults import Faults
from kvrouter.up import (
    ENGINE_READY,
    PROCESS_READY,
    ROUTER_READY,
    Child,
    UpError,
    answers_ok,
    engine_argv,
    router_argv,
    spawn,
    stop_children,
    wait_until,
    worker_spec,
)

__all__ = ["EngineCounters", "Fleet", "FleetSpec", "UpError", "cpu_seconds", "wait_until"]

_PROC = Path("/proc")
TPOT = "vllm:request_time_per_output_token_seconds"  # vLLM's per-request TPOT histogram


@dataclass(frozen=True)
class FleetSpec:
    workers: int = 8
    block_size: int = 16
    gpu_blocks: int = 65536
    cpu_blocks: int = 0
    #: the sim engines' own speedup (every modeled delay divided by it)
    speedup: float = 1.0
    engine_args: tuple[str, ...] = ()
    ready_timeout: float = 120.0
    #: a prefill/decode fleet instead of ``workers`` aggregated engines: P ``--role prefill``
    #: engines (prefill-0...), then D ``--role decode`` (decode-0...), as ``kvrouter up --pd``
    pd: tuple[int, int] | None = None
    #: the first that many engines are the router's workers without events
    no_events: int = 0
    #: faults on the way from the engines to the router, and the closed loop on or off
    faults: Faults = field(default_factory=Faults)
    #: the relays' random choices (engine i's relay draws from seed + i)
    seed: int = 0

    @property
    def roles(self) -> list[str]:
        """Each engine's ``--role``, in start order (all ``both`` when not PD)."""
        if self.pd is None:
            return ["both"] * self.workers
        return ["prefill"] * self.pd[0] + ["decode"] * self.pd[1]


@dataclass(frozen=True)
class EngineCounters:
    """One engine's counters, scraped from its ``/metrics`` after a policy's run."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    preemptions: int
    #: its ``--role`` (prefill, decode, or both)
    role: str = "both"
    #: prompt tokens looked up in its prefix cache (a preempted request's recompute looks again)
    queried_tokens: int = 0
    #: its ``kvrouter_engine_pd_*`` samples, each summed over its labels (engine.metrics), and
    #: by reason (``NAME:REASON``, ``NAME:HOW``); and the sum and count of its ``TPOT``
    pd: dict[str, float] = field(default_factory=dict)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and its live descendants (None: no /proc, or gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, seconds)
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        fields = raw[raw.rfind(")") + 2 :].split()  # the command name may hold spaces
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    if pid not in stats:
        return None
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo.extend(c for c, (ppid, _) in stats.items() if ppid == p)
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Fleet:
    """N engines and at most one router; a context manager that stops them all on exit."""

    def __init__(self, spec: FleetSpec, log: TextIO | None = None) -> None:
        self.spec = spec
        self.log = log
        self.children: list[Child] = []
        self.engine_urls: list[str] = []
        self.worker_specs: list[str] = []
        #: each engine's KV event endpoint (vllm-router's ``--pd-kv-events``)
        self.event_urls: list[str] = []
        #: each engine's ENGINE_READY groups: (url, events, replay)
        self.endpoints: list[tuple[str, ...]] = []
        #: closed after the children (the relays of :func:`kvrouter.replay.relay.relayed_specs`)
        self.exits = contextlib.ExitStack()
        self._restart: threading.Timer | None = None
        self.router_url: str | None = None
        self.router_pid: int | None = None
        #: the router's EPP port (start_kvrouter(epp=True)) and the Envoy in front of it
        self.epp_port: int | None = None
        self.gateway: EnvoyProcess | None = None
        self._stop = threading.Event()

    def __enter__(self) -> Fleet:
        try:
            self.start_engines()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._restart is not None:
            self._restart.cancel()
        if self.gateway is not None:  # first: it stops sending traffic
            self.gateway.stop()
        stop_children(self.children)
        self.children.clear()
        self.exits.close()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = spawn(name, argv, log=self.log, env=env)
        self.children.append(child)
        return child

    def start_engines(self) -> None:
        s = self.spec
        roles = s.roles
        pd = s.pd is not None
        names = [f"{r}-{roles[:i].count(r)}" if pd else f"engine-{i}" for i, r in enumerate(roles)]
        engines = [
            self._spawn(
                names[i],
                engine_argv(
                    i,
                    block_size=s.block_size,
                    gpu_blocks=s.gpu_blocks,
                    cpu_blocks=s.cpu_blocks,
                    speedup=s.speedup,
                    extra=[
                        "--log-level",
                        "warning",
                        *(["--role", role] if pd else []),
                        *s.engine_args,
                    ],
                ),
            )
            for i, role in enumerate(roles)
        ]
        for child, role in zip(engines, roles):  # they start in parallel
            ready = child.wait_line(ENGINE_READY, s.ready_timeout, self._stop)
            self.engine_urls.append(ready.group(1))
            self.event_urls.append(ready.group(2))
            self.worker_specs.append(worker_spec(child.name, ready, role=role if pd else None))
            self.endpoints.append(ready.groups())

    def urls_of(self, role: str) -> list[str]:
        return [u for u, r in zip(self.engine_urls, self.spec.roles) if r == role]

    def schedule_restart(self, after_s: float) -> None:
        """The faults' silent restart, ``after_s`` from now: the last ``restart_k`` engines
        forget their cache (their relays swallow the ``AllBlocksCleared``)."""
        k = self.spec.faults.restart_k
        if not k:
            return

        def restart() -> None:
            for url in self.engine_urls[-k:]:
                httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()

        self._restart = threading.Timer(after_s, restart)
        self._restart.daemon = True
        self._restart.start()

    def start_kvrouter(
        self,
        config: str | None = None,
        env: dict[str, str] | None = None,
        *,
        epp: bool = False,
        processes: int = 1,
        specs: Sequence[str] | None = None,
    ) -> str:
        """The router (``specs``: its workers, default each engine's own streams); with ``epp``
        its endpoint picker too, on a free port (``epp_port``); with ``processes`` > 1,
        ``kvrouter serve --processes N``: N synced replicas on one port, the kernel spreading
        connections, ready once every one of them listens."""
        argv = router_argv(specs or self.worker_specs, block_size=self.spec.block_size)
        argv += ["--log-level", "warning", *(["--config", config] if config else [])]
        if not self.spec.faults.loop:
            env = {"KVROUTER_AGREEMENT__ENABLED": "false", **(env or {})}
        if processes > 1:
            if epp:  # (its EPP line and the processes' lines would race for wait_line)
                raise UpError("the fleet's router runs as one process when it serves EPP")
            argv += ["--processes", str(processes)]
        if epp:
            env = {**EPP_ENV, **(env or {})}
        child = self._spawn("router", argv, env)
        url = child.wait_line(ROUTER_READY, self.spec.ready_timeout, self._stop).group(1)
        for _ in range(processes - 1):  # (the first one's line came before ROUTER_READY)
            child.wait_line(PROCESS_READY, self.spec.ready_timeout, self._stop)
        if epp:  # (printed right after the HTTP listener's line)
            ready = child.wait_line(EPP_READY, self.spec.ready_timeout, self._stop)
            self.epp_port = int(ready.group(2))
        wait_until(lambda: answers_ok(url + "/ready"), self.spec.ready_timeout, "router /ready")
        self.router_url, self.router_pid = url, child.proc.pid
        return url

    def start_sglang_router(self, python: str, extra: Sequence[str] = ()) -> str:
        """sglang-router (0.3.2) with ``--policy cache_aware``, from ``python``."""
        return self._start_sglang_family("sglang-router", python, "sglang_router", extra)

    def start_smg(self, python: str, extra: Sequence[str] = ()) -> str:
        """smg (SGLang's gateway, 1.13) with ``--policy cache_aware``, from ``python``: the same
        command line and readiness probe as sglang-router, its predecessor."""
        return self._start_sglang_family("smg", python, "smg", extra)

    def _start_sglang_family(
        self, name: str, python: str, package: str, extra: Sequence[str]
    ) -> str:
        port, metrics_port = _free_port(), _free_port()
        workers = ["--worker-urls", *self.engine_urls]
        if self.spec.pd is not None:  # its PD mode, on vLLM's protocol (smg's --backend vllm)
            workers = ["--pd-disaggregation", "--backend", "vllm"]
            workers += [a for u in self.urls_of("prefill") for a in ("--prefill", u)]
            workers += [a for u in self.urls_of("decode") for a in ("--decode", u)]
        argv = [
            python, "-m", f"{package}.launch_router", *workers,
            "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", "warn", *extra,
        ]  # fmt: skip
        child = self._spawn(name, argv)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:  # it registers workers in the background after it listens
            if child.proc.poll() is not None:
                raise UpError(f"{name} exited with status {child.proc.returncode}")
            body = _json(url + "/readiness")
            return body is not None and body.get("healthy_workers") == len(self.engine_urls)

        wait_until(ready, self.spec.ready_timeout, f"{name} to register every engine")
        self.router_url, self.router_pid = url, child.proc.pid
        return url

    def start_vllm_router(self, binary: str, policy: str = "kv_aware") -> str:
        """vllm-router (0.1.17) with ``--vllm-pd-disaggregation`` in front of a PD fleet, every
        engine with ``--policy policy``; ``kv_aware`` reads the prefill engines' KV events
        (``--pd-kv-events``), as its docs ask."""
        if self.spec.pd is None:
            raise UpError("vllm-router runs here on a prefill/decode fleet (FleetSpec.pd)")
        port = _free_port()
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
        argv += [a for u in self.urls_of("prefill") for a in ("--prefill", u)]
        argv += [a for u in self.urls_of("decode") for a in ("--decode", u)]
        argv += ["--policy", policy]
        if policy == "kv_aware":  # (one flag per prefill engine)
            argv += ["--kv-event-block-size", str(self.spec.block_size)]
            for url, events, role in zip(self.engine_urls, self.event_urls, self.spec.roles):
                argv += ["--pd-kv-events", f"{url}={events}"] if role == "prefill" else []
        child = self._spawn("vllm-router", argv)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if child.proc.poll() is not None:
                raise UpError(f"vllm-router exited with status {child.proc.returncode}")
            return answers_ok(url + "/health")

        wait_until(ready, self.spec.ready_timeout, "vllm-router /health")
        self.router_url, self.router_pid = url, child.proc.pid
        return url

    def start_gateway(self, binary: str | None = None, *, head_only: bool = False) -> str:
        """An Envoy on ``deploy/gateway/envoy.yaml`` in front of the router's EPP (after
        ``start_kvrouter(epp=True)``; ``head_only``: the answer's body never reaches the EPP,
        :func:`kvrouter.gateway.render`); returns its listener's URL."""
        if self.epp_port is None:
            raise UpError("start_gateway needs a router with its EPP (start_kvrouter(epp=True))")
        config = render(load(), epp=("127.0.0.1", self.epp_port), head_only=head_only)
        self.gateway = EnvoyProcess(config, binary=binary, ready_timeout=self.spec.ready_timeout)
        return self.gateway.start().url

    def router_cpu(self) -> float | None:
        return cpu_seconds(self.router_pid) if self.router_pid is not None else None

    def gateway_cpu(self) -> float | None:
        return cpu_seconds(self.gateway.pid) if self.gateway is not None else None

    def counters(self) -> list[EngineCounters]:
        return [engine_counters(u, r) for u, r in zip(self.engine_urls, self.spec.roles)]

    def loop_turns(self) -> str:
        """What the kvrouter's closed loop did, from its ``/metrics``: each worker it turned to
        its approximate tree, how often and why (``engine-7 x2 index_ahead``), else ``-``."""
        assert self.router_url is not None
        text = httpx.get(self.router_url + "/metrics", timeout=10).text
        turns = [
            f"{s.labels['worker']} x{s.value:g} {s.labels['reason']}"
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "kvrouter_agreement_disagreements_total" and s.value > 0
        ]
        return " ".join(sorted(turns)) or "-"


def engine_counters(url: str, role: str = "both") -> EngineCounters:
    """A bundled engine's (or vLLM's: same names) request, token and preemption counters."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            why = sample.labels.get("reason") or sample.labels.get("how")
            if why and sample.name.startswith("kvrouter_engine_pd_"):  # also by its reason
                values[f"{sample.name}:{why}"] = sample.value
    return EngineCounters(
        requests=int(values.get("vllm:e2e_request_latency_seconds_count", 0)),
        prompt_tokens=int(values.get("vllm:prompt_tokens_total", 0)),
        cached_tokens=int(values.get("vllm:prefix_cache_hits_total", 0)),
        preemptions=int(values.get("vllm:num_preemptions_total", 0)),
        role=role,
        queried_tokens=int(values.get("vllm:prefix_cache_queries_total", 0)),
        pd={k: v for k, v in values.items() if k.startswith(("kvrouter_engine_pd_", TPOT))},
    )


def _json(url: str) -> dict[str, Any] | None:
    try:
        r = httpx.get(url, timeout=2)
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None
