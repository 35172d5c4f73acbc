"""Virtual-time replay: a workload through a fleet of bundled engines on a simulated clock.

Each worker is the bundled engine itself (:class:`engine.engine.LLMEngine`: its scheduler, block
manager and prefix cache) with the sim runner in ``timing_only`` mode: a step returns its modeled
duration instead of sleeping it. A discrete-event loop owns the clock:

* an arrival is placed by the policy *at its time* and added to the chosen engine; an idle engine
  starts a step at once;
* a step started at ``t`` is computed then (it sees every request added up to ``t``) and its
  outputs — first tokens, finished requests — happen at ``t + step time``, when the engine
  starts its next step if it has work;
* the KV events a step published reach the policy (the router's index) ``event_delay_s`` after
  the step ended: the router sees the caches as late as a real subscriber would;
* a policy with a load monitor (``poll_s``) reads the engines every ``poll_s`` from the first
  arrival, while anything else is left to happen.

A prefill/decode fleet (``VirtualFleet.prefill`` > 0: that many prefill engines, the rest decode
engines; policy ``kvrouter`` only, :mod:`kvrouter.replay.pd_policy`) runs vLLM's NIXL exchange
with the engines' own PD paths (:mod:`engine.pd`): a remote pick's prefill leg (one token,
``kv_hold``) runs on the prefill engine, which leases its prompt blocks when it finishes; the run
takes the lease (``export_lease``, which frees them there) and, after the pull's modeled time
(the decode engine's ``copy_s(blocks, "REMOTE")``: bytes over ``transfer_gbps`` plus
``transfer_latency_ms``), adds the decode leg to the decode engine with the pulled blocks, which
it loads instead of computing (it computes only the prompt's last partial block, and publishes
the pulled blocks as stored). A request's TTFT runs from its arrival to the decode engine's first
token.

Nothing sleeps and nothing reads the wall clock, so a run is a function of the workload, the
fleet, the policy and the seed: the same inputs give the same table.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.engine import InvalidRequestError, LLMEngine, RequestOutput
from engine.runner import RunnerConfig
from engine.runner.sim import SimRunner
from engine.sequence import RemoteKV, Request
from kvrouter.replay.factory import make_policy
from kvrouter.replay.faults import FaultInjector, Faults, LoopLog, loop_settings
from kvrouter.replay.fleet import EngineCounters
from kvrouter.replay.live_client import LiveOutcome
from kvrouter.replay.pd_policy import KvrouterPdPolicy
from kvrouter.replay.policies import KvrouterPolicy
from kvrouter.replay.replicas import RouterReplicas
from kvrouter.replay.trace import TraceRequest, check_block_sizes, prompt_tokens
from router.settings import Settings

__all__ = ["VirtualFleet", "VirtualRun", "run_virtual"]

# at equal times: outputs land, then events, then pulled blocks, then a load poll, then arrivals
_STEP, _EVENTS, _PULLED, _POLL, _ARRIVE = 0, 1, 2, 3, 4
#: a prefill leg's request id: the trace index behind this prefix (a decode leg's is the index)
_PREFILL = "p"


@dataclass(frozen=True)
class VirtualFleet:
    workers: int = 8
    block_size: int = 16
    gpu_blocks: int = 65536
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    #: how long after a step its KV events reach the router (publish + network + apply)
    event_delay_s: float = 0.005
    #: the first that many workers publish no KV events (the router's approximate ranks)
    no_events: int = 0
    #: sim runner timing overrides (``SIM_DEFAULTS`` names)
    sim_options: dict[str, float] = field(default_factory=dict)
    #: a PD fleet: the first that many workers are prefill engines, the others decode engines
    #: (0: every worker aggregated, role ``both``)
    prefill: int = 0
    #: faults on the way from the engines to the router, and the loop on or off
    faults: Faults = field(default_factory=Faults)

    def roles(self) -> list[str]:
        """Each worker's role for the router's table (empty: all ``both``)."""
        if not self.prefill:
            return []
        return ["prefill"] * self.prefill + ["decode"] * (self.workers - self.prefill)


@dataclass
class VirtualRun:
    policy: str
    outcomes: list[LiveOutcome]
    #: simulated seconds from the first arrival to the last completion
    sim_s: float
    #: wall-clock seconds the run took on this machine
    wall_s: float
    engines: list[EngineCounters]
    #: what a PD fleet's run adds to its row (:func:`kvrouter.replay.report.row`)
    extra: dict[str, Any] = field(default_factory=dict)
    #: policy kvrouter (one router): the closed loop's turns
    loop: LoopLog | None = None


def _engine(fleet: VirtualFleet, seed: int) -> LLMEngine:
    # a PD fleet's engines move pulled blocks through staging slots: room for the largest lease
    # (half the GPU pool, engine.pd.leases), so a decode engine never computes a pull's rest
    staging = fleet.gpu_blocks // 2 if fleet.prefill else 0
    cfg = EngineConfig(
        block_size=fleet.block_size,
        num_gpu_blocks=fleet.gpu_blocks,
        num_staging_slots=staging,
        # leases expire on the wall clock: a run takes them the moment their leg finishes, but
        # that moment may be a while away in wall time on a busy machine
        kv_lease_s=3600.0,
        max_num_batched_tokens=fleet.max_num_batched_tokens,
        max_num_seqs=fleet.max_num_seqs,
        seed=seed,
    )
    runner = SimRunner(
        RunnerConfig(
            block_size=cfg.block_size,
            num_gpu_blocks=cfg.num_gpu_blocks,
            num_host_slots=staging,
            model="sim",
            seed=seed,
            options=dict(fleet.sim_options),
        ),
        timing_only=True,
    )
    return LLMEngine(cfg, runner)


class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_virtual(
    requests: Sequence[TraceRequest],
    policy_name: str,
    fleet: VirtualFleet,
    *,
    trace_block: int = 512,
    settings: Settings | None = None,
    seed: int = 0,
    on_done: Callable[[LiveOutcome], None] | None = None,
    replicas: RouterReplicas | None = None,
) -> VirtualRun:
    """Replay ``requests`` through ``policy_name`` on a fresh virtual fleet (``replicas``: policy
    kvrouter through several routers, its row named by :attr:`RouterReplicas.label`)."""
    check_block_sizes(trace_block, fleet.block_size, requests)
    t_wall = time.perf_counter()
    sim = _Sim(requests, policy_name, fleet, trace_block, settings, seed, on_done, replicas)
    try:
        end = sim.run()
    finally:
        sim.policy.close()
    counters = []
    for w, engine in enumerate(sim.engines):
        mine = [o for o in sim.outcomes if o.worker == f"w{w}" and o.error is None]
        counters.append(
            EngineCounters(
                requests=len(mine),
                prompt_tokens=sum(o.prompt_tokens for o in mine),
                cached_tokens=sum(o.cached_tokens for o in mine),
                preemptions=engine.stats().preemptions,
            )
        )
        engine.close()
    first = requests[0].arrival_s if requests else 0.0
    label = replicas.label if replicas is not None and policy_name == "kvrouter" else policy_name
    extra: dict[str, Any] = {}
    if sim.pd is not None:
        mode = sim.pd.placer.config.pd.mode
        label = f"kvrouter {fleet.prefill}:{fleet.workers - fleet.prefill} {mode}"
        extra = _pd_columns(sim, fleet)
    label += fleet.faults.label(router=policy_name.startswith("kvrouter"))
    if isinstance(sim.policy, KvrouterPolicy) and (
        fleet.faults.label() or sim.policy.looplog.turns
    ):
        extra.update(sim.policy.looplog.columns())  # (the loop's turns, where it turned one)
    wall = time.perf_counter() - t_wall
    log = sim.policy.looplog if isinstance(sim.policy, KvrouterPolicy) else None
    if log is not None:  # its hook into the fleet ends with the run (a sweep's 22 held 16 GB)
        log.fresh = None
    return VirtualRun(label, sim.outcomes, end - first, wall, counters, extra, log)


def _pd_columns(sim: _Sim, fleet: VirtualFleet) -> dict[str, Any]:
    """A PD run's own columns: the share of requests prefilled on a prefill engine, the remote
    picks that fell back, and the longest prefill chunk a decode engine ran in one step (the
    prompt's last partial block when every pull landed: at most a block)."""
    decode = [e.runner for e in sim.engines[fleet.prefill :]]
    longest = [r.longest_prefill for r in decode if isinstance(r, SimRunner)]
    return {
        "remote_%": round(sim.remote / max(1, len(sim.outcomes)) * 100, 1),
        "fallback": sim.fallbacks,
        "d_max_prefill": max(longest, default=0),
    }


class _Sim:
    """One run's discrete-event loop (see the module docstring)."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        policy_name: str,
        fleet: VirtualFleet,
        trace_block: int,
        settings: Settings | None,
        seed: int,
        on_done: Callable[[LiveOutcome], None] | None,
        replicas: RouterReplicas | None = None,
    ) -> None:
        self.requests = requests
        self.trace_block = trace_block
        self.delay = fleet.event_delay_s
        self.on_done = on_done
        self.clock = _Clock()
        self.engines = [_engine(fleet, seed) for _ in range(fleet.workers)]
        self.policy = make_policy(
            policy_name,
            self.engines,
            seed=seed,
            settings=loop_settings(settings or Settings(block_size=fleet.block_size), fleet.faults),
            clock=self.clock,
            replicas=replicas,
            no_events=fleet.no_events,
            roles=fleet.roles(),
        )
        middle = (requests[0].arrival_s + requests[-1].arrival_s) / 2 if requests else 0.0
        self.faults = FaultInjector(fleet.faults, fleet.workers, middle, seed)
        self.faults.attach(self.policy, self.clock)
        self.pd = self.policy if isinstance(self.policy, KvrouterPdPolicy) else None
        #: PD: requests between their two legs (trace index -> decode engine, prompt)
        self.legs: dict[int, tuple[int, list[int]]] = {}
        self.remote = self.fallbacks = 0
        self.outcomes = [LiveOutcome(i) for i in range(len(requests))]
        self.handles: dict[int, Any] = {}
        self.busy = [False] * len(self.engines)
        self.order = itertools.count()
        self.heap: list[tuple[float, int, int, Any]] = [
            (r.arrival_s, _ARRIVE, next(self.order), i) for i, r in enumerate(requests)
        ]
        if self.policy.poll_s is not None and requests:
            self.heap.append((requests[0].arrival_s, _POLL, next(self.order), None))
        heapq.heapify(self.heap)
        self.blocks: dict[int, list[int]] = {}  # trace block tokens, cleared past a bound

    def run(self) -> float:
        heap, end = self.heap, 0.0
        while heap:
            now, kind, _, data = heapq.heappop(heap)
            self.clock.now = now
            if kind == _POLL:  # not an end: the last poll may come after the last completion
                self.policy.poll(now)
                if heap:  # polls only while something else is still to happen
                    poll_s = self.policy.poll_s
                    assert poll_s is not None
                    heapq.heappush(heap, (now + poll_s, _POLL, next(self.order), None))
                continue
            end = now
            if kind == _ARRIVE:
                self.arrive(data, now)
            elif kind == _STEP:
                w, outputs = data
                self.busy[w] = False
                self.landed(w, outputs, now)
                if self.engines[w].has_work:
                    self.start_step(w, now)
            elif kind == _PULLED:
                self.pulled(*data, now)
            else:
                w, events = data
                self.policy.events(w, events, now)
        return end

    def arrive(self, i: int, now: float) -> None:
        r = self.requests[i]
        self.faults.arrive(now, self.engines)
        if len(self.blocks) > 100_000:
            self.blocks.clear()
        tokens = prompt_tokens(r, self.trace_block, self.blocks)
        req = Request(str(i), tokens, r.output_length, ignore_eos=True)
        out = self.outcomes[i]
        if self.pd is not None:
            w, pw, handle = self.pd.place_pd(tokens, now, r.output_length)
            out.pd = handle.pick.mode
            if pw is not None:  # the prefill leg first, one token, its blocks leased at the end
                self.legs[i] = (w, tokens)
                req = Request(f"{_PREFILL}{i}", tokens, 1, ignore_eos=True, kv_hold=True)
                out.prefill_worker, w = f"w{pw}", pw
        else:
            w, handle = self.policy.place(tokens, now)
        out.worker, out.prompt_tokens = f"w{w}", len(tokens)
        self.handles[i] = handle
        self.submit(i, w, req, now)

    def submit(self, i: int, w: int, req: Request, now: float) -> None:
        """Add a request (or leg) to engine ``w``, which starts a step if idle."""
        out = self.outcomes[i]
        try:
            self.engines[w].add_request(req)
        except InvalidRequestError as e:
            out.error = str(e)
            self.legs.pop(i, None)
            self.policy.finish(self.handles.pop(i), now)
            if self.on_done is not None:
                self.on_done(out)
            return
        if not self.busy[w]:
            self.start_step(w, now)

    def prefilled(self, w: int, o: RequestOutput, now: float) -> None:
        """A prefill leg finished on engine ``w``: the decode engine pulls its leased blocks
        (they arrive after the pull's modeled time), or prefills itself when none were leased."""
        assert self.pd is not None
        i = int(o.request_id[len(_PREFILL) :])
        handle = self.handles[i]
        self.pd.prefill_answered(handle, now, o.num_cached_tokens)
        dw, tokens = self.legs[i]
        lease = o.kv_lease
        if lease is None:  # (too large to lease: the proxy gets no kv_transfer_params)
            self.fallbacks += 1
            self.legs.pop(i)
            self.pd.decode_sent(handle, now, fallback="no_params")
            out = self.outcomes[i]  # (as the router's headers say after a fallback)
            out.worker, out.pd, out.prefill_worker = f"w{dw}", handle.pick.mode, None
            self.submit(i, dw, Request(str(i), tokens, self.requests[i].output_length,
                                       ignore_eos=True), now)  # fmt: skip
            return
        _, blobs = self.engines[w].export_lease(lease.transfer_id, list(lease.block_ids))
        kv = RemoteKV(blobs, 0, lease.cached_tokens)
        runner = self.engines[dw].runner
        assert isinstance(runner, SimRunner)
        at = now + runner.copy_s(len(blobs), "REMOTE")
        heapq.heappush(self.heap, (at, _PULLED, next(self.order), (i, kv)))

    def pulled(self, i: int, kv: RemoteKV, now: float) -> None:
        """A decode leg's blocks arrived: it goes to its decode engine with them."""
        assert self.pd is not None
        dw, tokens = self.legs.pop(i)
        self.remote += 1
        self.pd.decode_sent(self.handles[i], now)
        self.outcomes[i].worker = f"w{dw}"
        req = Request(str(i), tokens, self.requests[i].output_length, ignore_eos=True,
                      remote_kv=kv)  # fmt: skip
        self.submit(i, dw, req, now)

    def start_step(self, w: int, now: float) -> None:
        engine = self.engines[w]
        runner = engine.runner
        assert isinstance(runner, SimRunner)
        before = runner.busy_s
        outputs = engine.step()
        if not outputs and runner.busy_s == before and engine.scheduler.loading:
            # only decode legs went to LOADING: their copies take no time here (the pull was
            # timed before the leg came), so they are in at the next step, at this same time
            outputs = engine.step()
        elapsed = runner.busy_s - before
        if elapsed <= 0.0 and not outputs:
            raise RuntimeError(
                f"virtual worker w{w} has work but could schedule nothing (a request larger "
                "than its cache?)"
            )
        self.busy[w] = True
        heapq.heappush(self.heap, (now + elapsed, _STEP, next(self.order), (w, outputs)))
        at = now + elapsed + self.delay
        events = self.faults.events(w, engine.drain_events(), at)
        if events:
            heapq.heappush(self.heap, (at, _EVENTS, next(self.order), (w, events)))

    def landed(self, w: int, outputs: list[RequestOutput], now: float) -> None:
        for o in outputs:
            if o.request_id.startswith(_PREFILL):
                self.prefilled(w, o, now)
                continue
            i = int(o.request_id)
            out = self.outcomes[i]
            if out.ttft_s is None:
                out.ttft_s = now - self.requests[i].arrival_s
                out.cached_tokens = o.num_cached_tokens
                self.policy.first_token(self.handles[i], now)
            out.output_tokens = o.num_output_tokens
            if o.finished:
                out.e2e_s = now - self.requests[i].arrival_s
                self.policy.finish(self.handles.pop(i), now, out.cached_tokens)
                if self.on_done is not None:
                    self.on_done(out)
