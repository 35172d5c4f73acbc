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
  the step ended: the router sees the caches as late as a real subscriber would.

Nothing sleeps and nothing reads the wall clock, so a run is a function of the workload, the
fleet, the policy and the seed: the same inputs give the same table.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine import InvalidRequestError, LLMEngine, RequestOutput
from engine.runner import RunnerConfig
from engine.runner.sim import SimRunner
from engine.sequence import Request
from kvrouter.replay.fleet import EngineCounters
from kvrouter.replay.live_client import LiveOutcome
from kvrouter.replay.policies import make_policy
from kvrouter.replay.trace import TraceRequest, check_block_sizes, prompt_tokens
from router.settings import Settings

__all__ = ["VirtualFleet", "VirtualRun", "run_virtual"]

_STEP, _EVENTS, _ARRIVE = 0, 1, 2  # at equal times: outputs land, then events, then arrivals


@dataclass(frozen=True)
class VirtualFleet:
    workers: int = 8
    block_size: int = 16
    gpu_blocks: int = 65536
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    #: how long after a step its KV events reach the router (publish + network + apply)
    event_delay_s: float = 0.005
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
) -> VirtualRun:
    """Replay ``requests`` through ``policy_name`` on a fresh virtual fleet."""
    check_block_sizes(trace_block, fleet.block_size, requests)
    t_wall = time.perf_counter()
    clock = _Clock()
    engines = [_engine(fleet, seed) for _ in range(fleet.workers)]
    runners = [e.runner for e in engines]
    policy = make_policy(
        policy_name,
        engines,
        seed=seed,
        settings=settings or Settings(block_size=fleet.block_size),
        clock=clock,
    )
    outcomes = [LiveOutcome(i) for i in range(len(requests))]
    handles: dict[int, object] = {}
    busy = [False] * len(engines)
    heap: list[tuple[float, int, int, object]] = []
    order = itertools.count()
    for i, r in enumerate(requests):
        heap.append((r.arrival_s, _ARRIVE, next(order), i))
    heapq.heapify(heap)
    delay = fleet.event_delay_s
    blocks: dict[int, list[int]] = {}  # trace block tokens, bounded below

    def start_step(w: int, now: float) -> None:
        engine, runner = engines[w], runners[w]
        before = runner.busy_s  # type: ignore[attr-defined]
        outputs = engine.step()
        elapsed = runner.busy_s - before  # type: ignore[attr-defined]
        if elapsed <= 0.0 and not outputs:
            raise RuntimeError(
                f"virtual worker w{w} has work but could schedule nothing (a request larger "
                "than its cache?)"
            )
        busy[w] = True
        heapq.heappush(heap, (now + elapsed, _STEP, next(order), (w, outputs)))
        events = engine.drain_events()
        if events:
            heapq.heappush(heap, (now + elapsed + delay, _EVENTS, next(order), (w, events)))

    def landed(w: int, outputs: list[RequestOutput], now: float) -> None:
        for o in outputs:
            i = int(o.request_id)
            out = outcomes[i]
            if out.ttft_s is None:
                out.ttft_s = now - requests[i].arrival_s
                out.cached_tokens = o.num_cached_tokens
                policy.first_token(handles[i], now)
            out.output_tokens = o.num_output_tokens
            if o.finished:
                out.e2e_s = now - requests[i].arrival_s
                policy.finish(handles.pop(i), now)
                if on_done is not None:
                    on_done(out)

    end = 0.0
    while heap:
        now, kind, _, data = heapq.heappop(heap)
        clock.now = end = now
        if kind == _ARRIVE:
            i = data  # type: ignore[assignment]
            r = requests[i]  # type: ignore[index]
            if len(blocks) > 100_000:
                blocks.clear()
            tokens = prompt_tokens(r, trace_block, blocks)
            w, handle = policy.place(tokens, now)
            out = outcomes[i]  # type: ignore[index]
            out.worker, out.prompt_tokens = f"w{w}", len(tokens)
            try:
                engines[w].add_request(Request(str(i), tokens, r.output_length, ignore_eos=True))
            except InvalidRequestError as e:
                out.error = str(e)
                policy.finish(handle, now)
                if on_done is not None:
                    on_done(out)
                continue
            handles[i] = handle  # type: ignore[index]
            if not busy[w]:
                start_step(w, now)
        elif kind == _STEP:
            w, outputs = data  # type: ignore[misc]
            busy[w] = False
            landed(w, outputs, now)
            if engines[w].has_work:
                start_step(w, now)
        else:
            w, events = data  # type: ignore[misc]
            policy.events(w, events, now)
    counters = []
    for w, engine in enumerate(engines):
        mine = [o for o in outcomes if o.worker == f"w{w}" and o.error is None]
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
    return VirtualRun(policy_name, outcomes, end - first, time.perf_counter() - t_wall, counters)
