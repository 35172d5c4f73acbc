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
from engine.sequence import Request
from kvrouter.replay.factory import make_policy
from kvrouter.replay.fleet import EngineCounters
from kvrouter.replay.live_client import LiveOutcome
from kvrouter.replay.replicas import RouterReplicas
from kvrouter.replay.trace import TraceRequest, check_block_sizes, prompt_tokens
from router.settings import Settings

__all__ = ["VirtualFleet", "VirtualRun", "run_virtual"]

# at equal times: outputs land, then events, then a load poll, then arrivals
_STEP, _EVENTS, _POLL, _ARRIVE = 0, 1, 2, 3


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


@dataclass
class VirtualRun:
    policy: str
    outcomes: list[LiveOutcome]
    #: simulated seconds from the first arrival to the last completion
    sim_s: float
    #: wall-clock seconds the run took on this machine
    wall_s: float
    engines: list[EngineCounters]


def _engine(fleet: VirtualFleet, seed: int) -> LLMEngine:
    cfg = EngineConfig(
        block_size=fleet.block_size,
        num_gpu_blocks=fleet.gpu_blocks,
        num_staging_slots=0,
        max_num_batched_tokens=fleet.max_num_batched_tokens,
        max_num_seqs=fleet.max_num_seqs,
        seed=seed,
    )
    runner = SimRunner(
        RunnerConfig(
            block_size=cfg.block_size,
            num_gpu_blocks=cfg.num_gpu_blocks,
            num_host_slots=0,
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
    return VirtualRun(label, sim.outcomes, end - first, time.perf_counter() - t_wall, counters)


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
            settings=settings or Settings(block_size=fleet.block_size),
            clock=self.clock,
            replicas=replicas,
            no_events=fleet.no_events,
        )
        self.outcomes = [LiveOutcome(i) for i in range(len(requests))]
        self.handles: dict[int, object] = {}
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
                self.landed(outputs, now)
                if self.engines[w].has_work:
                    self.start_step(w, now)
            else:
                w, events = data
                self.policy.events(w, events, now)
        return end

    def arrive(self, i: int, now: float) -> None:
        r = self.requests[i]
        if len(self.blocks) > 100_000:
            self.blocks.clear()
        tokens = prompt_tokens(r, self.trace_block, self.blocks)
        w, handle = self.policy.place(tokens, now)
        out = self.outcomes[i]
        out.worker, out.prompt_tokens = f"w{w}", len(tokens)
        try:
            self.engines[w].add_request(Request(str(i), tokens, r.output_length, ignore_eos=True))
        except InvalidRequestError as e:
            out.error = str(e)
            self.policy.finish(handle, now)
            if self.on_done is not None:
                self.on_done(out)
            return
        self.handles[i] = handle
        if not self.busy[w]:
            self.start_step(w, now)

    def start_step(self, w: int, now: float) -> None:
        engine = self.engines[w]
        runner = engine.runner
        assert isinstance(runner, SimRunner)
        before = runner.busy_s
        outputs = engine.step()
        elapsed = runner.busy_s - before
        if elapsed <= 0.0 and not outputs:
            raise RuntimeError(
                f"virtual worker w{w} has work but could schedule nothing (a request larger "
                "than its cache?)"
            )
        self.busy[w] = True
        heapq.heappush(self.heap, (now + elapsed, _STEP, next(self.order), (w, outputs)))
        events = engine.drain_events()
        if events:
            at = now + elapsed + self.delay
            heapq.heappush(self.heap, (at, _EVENTS, next(self.order), (w, events)))

    def landed(self, outputs: list[RequestOutput], now: float) -> None:
        for o in outputs:
            i = int(o.request_id)
            out = self.outcomes[i]
            if out.ttft_s is None:
                out.ttft_s = now - self.requests[i].arrival_s
                out.cached_tokens = o.num_cached_tokens
                self.policy.first_token(self.handles[i], now)
            out.output_tokens = o.num_output_tokens
            if o.finished:
                out.e2e_s = now - self.requests[i].arrival_s
                self.policy.finish(self.handles.pop(i), now)
                if self.on_done is not None:
                    self.on_done(out)
