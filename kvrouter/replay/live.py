"""Live replay: one trace through each policy against running servers, one policy after another.

Where the requests go (:class:`LiveTargets`): a fleet of our own, fresh for each policy
(:mod:`kvrouter.replay.fleet`: N bundled sim engines, and kvrouter, sglang-router or smg in front
of them; ``kvrouter-epp``: the same router as an endpoint picker behind a real Envoy;
``kvrouter-epp-head``: the same with Envoy sending it the answer's head, not its body), or servers
already running — a kvrouter URL, an sglang-router or smg URL, OpenAI worker URLs for
the client-side policies (their prefix caches are reset between policies where the workers allow
``POST /reset_prefix_cache``). The client (:mod:`kvrouter.replay.live_client`) paces, streams and
measures; a :class:`PolicyRun` carries what it saw plus the router's CPU seconds (and Envoy's, for
``kvrouter-epp``) and the engines' counters. A fleet of our own may mix workers without events
and carry faults (``--no-events``, ``--fault-*``, ``--loop``: :mod:`kvrouter.replay.fleet`); the
rows of the routers that read events say so, as in virtual time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import httpx

from kvrouter.gateway import GatewayError, envoy_binary
from kvrouter.replay.faults import Faults, faults_of, row_suffix
from kvrouter.replay.fleet import EngineCounters, Fleet, FleetSpec, cpu_seconds, engine_counters
from kvrouter.replay.live_client import (
    CLIENT_POLICIES,
    ClientPolicy,
    LiveOutcome,
    LiveRequest,
    drive,
    model_of,
)
from kvrouter.replay.live_pd import engine_tpot_ms, pd_columns, pd_label
from kvrouter.replay.relay import relayed_specs

__all__ = [
    "EPP_HEAD_POLICY",
    "EPP_POLICIES",
    "EPP_POLICY",
    "PEER_POLICIES",
    "LiveTargets",
    "PolicyRun",
    "add_live_arguments",
    "run_policy",
    "targets_from_args",
]

# ------------------------------------------------------------------------- one run per policy

PEER_POLICIES = (
    "kvrouter", "kvrouter-epp", "kvrouter-epp-head", "sglang", "smg", "vllm-router",
    "kvrouter-aggregated",
)  # fmt: skip
#: policy kvrouter through a real Envoy that asks the router's endpoint picker (kvrouter.gateway)
EPP_POLICY = "kvrouter-epp"
#: the same, Envoy sending the picker the answer's head and end only (response_body_mode NONE)
EPP_HEAD_POLICY = "kvrouter-epp-head"
EPP_POLICIES = (EPP_POLICY, EPP_HEAD_POLICY)


@dataclass
class LiveTargets:
    """Where live runs go: a fresh fleet per policy (``fleet``), or servers already running."""

    fleet: FleetSpec | None = None
    #: a running kvrouter (policy ``kvrouter``) and a running sglang-router (policy ``sglang``)
    router_url: str | None = None
    sglang_url: str | None = None
    smg_url: str | None = None
    #: workers for the client-side policies when there is no fleet of our own
    worker_urls: tuple[str, ...] = ()
    #: a Python with sglang-router installed: the fleet starts one in front of its engines
    sglang_python: str | None = None
    #: a Python with smg installed: the fleet starts one in front of its engines (policy smg)
    smg_python: str | None = None
    #: a router YAML for the fleet's kvrouter, and environment overrides (KVROUTER_...)
    router_config: str | None = None
    router_env: dict[str, str] = field(default_factory=dict)
    #: pids whose CPU time counts as the router's when the router is not ours (0: unknown)
    router_pid: int = 0
    #: the Envoy binary for policy kvrouter-epp (kvrouter.gateway.envoy_binary; None: not needed)
    envoy_bin: str | None = None
    #: the fleet's kvrouter as ``kvrouter serve --processes N``: N synced replicas on one port
    router_processes: int = 1
    #: a PD fleet (``fleet.pd``): the fleet's kvrouter's ``pd.mode`` (None: its own default);
    #: vllm-router's binary and ``--policy`` (policy ``vllm-router``)
    pd_mode: str | None = None
    vllm_router_bin: str | None = None
    vllm_router_policy: str = "kv_aware"


@dataclass
class PolicyRun:
    policy: str
    outcomes: list[LiveOutcome]
    wall_s: float
    #: CPU seconds the router process(es) used during the run (None: client-side or unknown)
    router_cpu_s: float | None = None
    #: per engine, from its /metrics after the run (empty when the workers are not ours)
    engines: list[EngineCounters] = field(default_factory=list)
    #: CPU seconds the gateway (Envoy, policy kvrouter-epp) used during the run
    gateway_cpu_s: float | None = None
    #: the row's own columns: a PD fleet's (:func:`pd_columns`); kvrouter with faults: ``turned``,
    #: what its closed loop did
    extra: dict[str, Any] = field(default_factory=dict)


def run_policy(
    policy: str,
    requests: Sequence[LiveRequest],
    targets: LiveTargets,
    *,
    speedup: float,
    seed: int = 0,
    max_inflight: int = 2048,
    log: TextIO | None = None,
    on_done: Callable[[LiveOutcome], None] | None = None,
) -> PolicyRun:
    """Run the whole of ``requests`` through one policy; a fleet of our own is fresh for it."""
    if policy not in CLIENT_POLICIES + PEER_POLICIES:
        raise ValueError(
            f"policy {policy!r} cannot run live (known: {CLIENT_POLICIES + PEER_POLICIES})"
        )
    if targets.fleet is None:
        return _run_external(policy, requests, targets, speedup, seed, max_inflight, on_done)
    spec = targets.fleet
    if spec.pd is None and policy in ("vllm-router", "kvrouter-aggregated"):
        raise ValueError(f"policy {policy} runs on a prefill/decode fleet (--pd P:D)")
    if policy == "kvrouter-aggregated":  # the PD fleet's engine count, all of them aggregated
        assert spec.pd is not None
        spec = replace(spec, pd=None, workers=sum(spec.pd))
    with Fleet(spec, log=log) as fleet:
        router: str | None = None
        client: ClientPolicy | None = None
        n = 1
        if policy == "kvrouter-aggregated":
            router = fleet.start_kvrouter(targets.router_config, targets.router_env)
        elif policy == "vllm-router":
            if not targets.vllm_router_bin:
                raise ValueError("policy vllm-router needs --vllm-router-bin")
            router = fleet.start_vllm_router(targets.vllm_router_bin, targets.vllm_router_policy)
        elif policy in ("kvrouter", *EPP_POLICIES):
            epp = policy in EPP_POLICIES
            n = 1 if epp else targets.router_processes  # (the EPP is process 0's alone)
            env = dict(targets.router_env)
            if spec.pd is not None and targets.pd_mode:
                env.setdefault("KVROUTER_PD__MODE", targets.pd_mode)
            # (no events, faults: kvrouter's alone; refused with --pd, whose specs carry roles)
            specs = relayed_specs(fleet)[0] if spec.no_events or spec.faults.label() else None
            router = fleet.start_kvrouter(
                targets.router_config, env, epp=epp, processes=n, specs=specs
            )
            if epp:  # the client calls Envoy, which asks the router's EPP
                router = fleet.start_gateway(targets.envoy_bin, head_only=policy == EPP_HEAD_POLICY)
        elif policy == "sglang":
            if not targets.sglang_python:
                raise ValueError("policy sglang on a fleet needs --sglang-router-python")
            router = fleet.start_sglang_router(targets.sglang_python)
        elif policy == "smg":
            if not targets.smg_python:
                raise ValueError("policy smg on a fleet needs --smg-python")
            router = fleet.start_smg(targets.smg_python)
        else:
            client = ClientPolicy(policy, fleet.engine_urls, seed)
        if requests:  # (virtual time's moment: the middle of the slice's arrivals)
            fleet.schedule_restart((requests[-1].arrival_s - requests[0].arrival_s) / 2 / speedup)
        cpu0, gw0 = fleet.router_cpu(), fleet.gateway_cpu()
        start = time.perf_counter()
        base = router or fleet.engine_urls[0]
        outcomes = asyncio.run(
            _drive(requests, speedup, base, router, client, max_inflight, on_done)
        )
        wall = time.perf_counter() - start
        cpu1, gw1 = fleet.router_cpu(), fleet.gateway_cpu()
        cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        gw = gw1 - gw0 if gw0 is not None and gw1 is not None else None
        label = policy if policy != "kvrouter" or n == 1 else f"kvrouter ({n} processes)"
        if targets.fleet.pd is not None:  # named as the virtual sweep names its rows
            label = pd_label(policy, targets.fleet.pd, spec.workers, targets)
        ours = policy.startswith("kvrouter")
        label += row_suffix(spec.faults, spec.no_events if ours else 0, spec.workers, ours)
        counters = fleet.counters()
        extra = pd_columns(counters) if spec.pd is not None else {}
        if targets.fleet.pd is not None:  # every row of a PD run, aggregated too
            extra["eng_tpot_ms"] = engine_tpot_ms(counters)
        if ours and targets.fleet.faults.label():
            extra["turned"] = fleet.loop_turns()
        return PolicyRun(label, outcomes, wall, cpu, counters, gateway_cpu_s=gw, extra=extra)


def _run_external(
    policy: str,
    requests: Sequence[LiveRequest],
    t: LiveTargets,
    speedup: float,
    seed: int,
    max_inflight: int,
    on_done: Callable[[LiveOutcome], None] | None,
) -> PolicyRun:
    if policy in EPP_POLICIES:  # (a running Envoy's EPP router could be anywhere: not measured)
        raise ValueError(f"policy {policy} runs on a fleet of our own (no --*-url)")
    router = {"kvrouter": t.router_url, "sglang": t.sglang_url, "smg": t.smg_url}.get(policy)
    if policy in PEER_POLICIES and not router:
        raise ValueError(f"policy {policy} needs its router URL (or a fleet of our own)")
    client = None if router else ClientPolicy(policy, t.worker_urls, seed)
    for url in t.worker_urls:  # every policy starts from empty caches, where the workers allow
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(url.rstrip("/") + "/reset_prefix_cache", timeout=30)
    cpu0 = cpu_seconds(t.router_pid) if router and t.router_pid else None
    start = time.perf_counter()
    outcomes = asyncio.run(
        _drive(requests, speedup, router or t.worker_urls[0], router, client, max_inflight, on_done)
    )
    wall = time.perf_counter() - start
    cpu1 = cpu_seconds(t.router_pid) if cpu0 is not None else None
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    engines = []
    with contextlib.suppress(httpx.HTTPError, ValueError):
        engines = [engine_counters(u) for u in t.worker_urls]
    return PolicyRun(policy, outcomes, wall, cpu, engines)


async def _drive(
    requests: Sequence[LiveRequest],
    speedup: float,
    model_from: str,
    router: str | None,
    client: ClientPolicy | None,
    max_inflight: int,
    on_done: Callable[[LiveOutcome], None] | None,
) -> list[LiveOutcome]:
    async with httpx.AsyncClient(timeout=30) as c:
        model = await model_of(c, model_from)
    return await drive(
        requests,
        speedup=speedup,
        model=model,
        router=router,
        policy=client,
        max_inflight=max_inflight,
        on_done=on_done,
    )


# ------------------------------------------------------------------------------- CLI options


def add_live_arguments(p: argparse.ArgumentParser) -> None:
    """``kvrouter replay --mode live`` options: where the requests go (see :class:`LiveTargets`)."""
    g = p.add_argument_group("live mode (--mode live)")
    a = g.add_argument
    a("--speedup", type=float, default=1.0, help="arrivals at timestamp / speedup (default 1)")
    a("--router-url", help="a running kvrouter for policy kvrouter (default: a fresh fleet's)")
    a("--sglang-router-url", help="a running sglang-router for policy sglang")
    a("--smg-url", help="a running smg for policy smg")
    a(
        "--sglang-router-python",
        metavar="PATH",
        help="a Python with sglang-router installed: the fleet starts it for policy sglang",
    )
    a(
        "--smg-python",
        metavar="PATH",
        help="a Python with smg (SGLang's gateway) installed: the fleet starts it for policy smg",
    )
    a(
        "--worker-url",
        action="append",
        default=[],
        metavar="URL",
        help="an OpenAI worker for the client-side policies (repeatable); none: a fresh fleet",
    )
    a("--router-pid", type=int, default=0, help="pid whose CPU counts as the given router's")
    a(
        "--router-processes",
        type=int,
        default=1,
        metavar="N",
        help="the fleet's kvrouter as N synced processes on one port (kvrouter serve "
        "--processes N; default 1); its row is named 'kvrouter (N processes)'",
    )
    a("--router-config", help="router YAML for the fleet's kvrouter (weights, knobs)")
    a(
        "--router-env",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="environment for the fleet's kvrouter (repeatable), e.g. KVROUTER_SCORING__OVERLAP_WEIGHT=8",
    )
    a("--cpu-blocks", type=int, default=0, help="fleet engines' CPU_PINNED tier (default 0)")
    a(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every fleet engine (repeatable), e.g. --engine-arg=--max-num-seqs=128",
    )
    a(
        "--envoy-bin",
        metavar="PATH",
        help=f"Envoy for policy {EPP_POLICY} (default: $KVROUTER_ENVOY_BIN, else .venv-envoy's, "
        "which .ci/envoy.sh installs)",
    )
    a(
        "--vllm-router-bin",
        metavar="PATH",
        help="vllm-router (0.1.17) for policy vllm-router on a --pd fleet",
    )
    a(
        "--vllm-router-policy",
        default="kv_aware",
        metavar="POLICIES",
        help="its --policy, comma-separated: a run each (default kv_aware)",
    )
    a("--max-inflight", type=int, default=2048, help="streams open at once (default 2048)")
    a("--children-log", help="file for the fleet's output (default: discarded)")


def targets_from_args(
    args: argparse.Namespace, *, workers: int, block_size: int, gpu_blocks: int, speedup: float
) -> LiveTargets:
    """The fleet (same shape as the virtual fleet, engines at the replay's speedup) unless
    servers are given; a router URL with no workers still needs no fleet for its policy.
    Policy kvrouter-epp needs a fleet and an Envoy binary: checked here, before any run."""
    external = bool(args.worker_url or args.router_url or args.sglang_router_url or args.smg_url)
    envoy_bin = None
    asked = set((getattr(args, "policies", None) or "").split(",")) & set(EPP_POLICIES)
    if asked:
        if external:
            raise ValueError(f"policy {min(asked)} runs on a fleet of our own (no --*-url)")
        try:
            envoy_bin = envoy_binary(args.envoy_bin)
        except GatewayError as e:
            raise ValueError(str(e)) from e
    if args.router_processes < 1:
        raise ValueError(f"--router-processes must be at least 1, got {args.router_processes}")
    if args.router_processes > 1 and external:
        raise ValueError("--router-processes starts the fleet's own router: not with --*-url")
    # (a parser with the live options alone, as the unit tests build, has no fault options)
    faults = faults_of(args) if "fault_drop" in vars(args) else Faults()
    no_events = getattr(args, "no_events", 0)
    if external and (faults.label() or no_events):
        raise ValueError("--no-events and --fault-* need a fleet of our own (no --*-url)")
    if not 0 <= no_events <= workers:
        raise ValueError(f"--no-events must be in [0, {workers}], got {no_events}")
    fleet = None
    pd = getattr(args, "pd", None)
    if pd and external:
        raise ValueError("--pd starts a prefill/decode fleet of our own: not with --*-url")
    if pd and (faults.label() or no_events):
        raise ValueError("--no-events and --fault-* run on an aggregated fleet: not with --pd")
    if not external:
        from kvrouter.replay.pd_sweep import parse_ratio

        fleet = FleetSpec(
            pd=parse_ratio(pd) if pd else None,
            workers=workers,
            block_size=block_size,
            gpu_blocks=gpu_blocks,
            cpu_blocks=args.cpu_blocks,
            speedup=speedup,
            engine_args=tuple(args.engine_arg),
            no_events=no_events,
            faults=faults,
            seed=getattr(args, "seed", 0),
        )
    return LiveTargets(
        fleet=fleet,
        router_url=args.router_url,
        sglang_url=args.sglang_router_url,
        worker_urls=tuple(args.worker_url),
        sglang_python=args.sglang_router_python,
        smg_url=args.smg_url,
        smg_python=args.smg_python,
        router_config=args.router_config,
        router_env=dict(args.router_env),
        router_pid=args.router_pid,
        envoy_bin=envoy_bin,
        router_processes=args.router_processes,
        vllm_router_bin=args.vllm_router_bin,
        vllm_router_policy=args.vllm_router_policy,
    )


def _key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--router-env wants KEY=VALUE, got {text!r}")
    return key, value
