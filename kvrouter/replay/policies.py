"""Placement policies of virtual-time replay: who gets each request, seen from inside the run.

Every policy answers ``place(request, tokens, now) -> (worker, handle)`` and hears back
``first_token(handle, now)``, ``finish(handle, now)`` and the KV events a worker published
(``events(worker, events, now)``, already delayed by the run). ``now`` is the simulated clock.

* ``random``, ``round_robin``, ``least_load`` (fewest requests outstanding, ties in turn): the
  client-side baselines, as in live mode.
* ``kvrouter``: the router itself — its placement core, :class:`router.placement.Placer`, on the
  simulated clock, over an index fed by the workers' events, ``place`` + ``fly`` as the proxy
  calls them, the flight's first byte at the first token and its end at the last, as the proxy.
  The index hears each step's events, and the placer with it (``Placer.blocks_stored``).
* ``kvrouter-early-head``: the same placement as the endpoint picker makes it with the answer's
  body kept off it (``kvrouter.gateway``'s head-only mode) in front of engines that send their
  answer's head at once, as vLLM does: the head comes at admission and no first token
  is seen, so each request's prefill ends with the events that show its prompt stored.
* ``cache_aware``: sglang-router 0.3.2's ``--policy cache_aware`` with its defaults, emulated so
  the peer's rule runs in virtual time too: a tree of what was *routed* to each worker (no KV
  event), requests outstanding as load; when ``max − min > 64`` and ``max > 1.5·min`` the least
  loaded worker, else the longest match if it covers more than 30 % of the prompt, else the
  worker with the smallest tree. Prefixes are matched in 16-token blocks, not characters, and the
  tree is never evicted (its cap is 2^26 characters). Live, the real one runs (policy ``sglang``).
* ``smg``, ``smg_dark``: smg 1.13.0's ``cache_aware`` (SGLang's gateway), its successor, with the
  load model it adds (:mod:`kvrouter.replay.smg`).
* ``oracle``: sees every engine's exact GPU cache and queue at decision time and picks the
  worker with the least modeled time to first token (the sim runner's own timing model). Greedy
  per request, so it is a strong reference, not an upper bound.

Each is built by name in :mod:`kvrouter.replay.factory`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from engine.engine import LLMEngine
from engine.runner.sim import SimRunner
from indexer.events import Event
from indexer.index import PrefixIndex
from kvrouter.replay.faults import LoopLog, watch_loop
from kvrouter.replay.trace import leading_run
from router.fleet.registry import Registry
from router.placement import PlacementSettings, Placer
from router.settings import EVENTS_NONE, Settings, WorkerConfig

__all__ = [
    "CacheAwarePolicy",
    "KvrouterEarlyHeadPolicy",
    "KvrouterPolicy",
    "LeastLoadPolicy",
    "OraclePolicy",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "modeled_ttft",
]


class Policy:
    """Base: counts requests outstanding per worker; subclasses choose."""

    name = ""
    #: seconds between the run's calls to ``poll`` (a load monitor's period); None: never
    poll_s: float | None = None

    def __init__(self, engines: Sequence[LLMEngine]) -> None:
        self.engines = engines
        self.outstanding = [0] * len(engines)

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        raise NotImplementedError

    def place(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        w, handle = self.choose(tokens, now)
        self.outstanding[w] += 1
        return w, (w, handle)

    def first_token(self, handle: Any, now: float) -> None:
        return None

    def finish(self, handle: Any, now: float, cached: int | None = None) -> None:
        """The answer ended; ``cached``: the prompt tokens its worker reported reused."""
        self.outstanding[handle[0]] -= 1

    def events(self, worker: int, events: Sequence[Event], now: float) -> None:
        return None

    def poll(self, now: float) -> None:
        return None

    def close(self) -> None:
        return None


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, engines: Sequence[LLMEngine], seed: int) -> None:
        super().__init__(engines)
        self.rng = random.Random(seed)

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        return self.rng.randrange(len(self.engines)), None


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, engines: Sequence[LLMEngine]) -> None:
        super().__init__(engines)
        self.next = 0

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        w = self.next
        self.next = (w + 1) % len(self.engines)
        return w, None


class LeastLoadPolicy(RoundRobinPolicy):
    name = "least_load"

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        n = len(self.engines)
        order = [(self.next + k) % n for k in range(n)]  # ties in turn
        w = min(order, key=lambda i: self.outstanding[i])
        self.next = (w + 1) % n
        return w, None


class KvrouterPolicy(Policy):
    name = "kvrouter"
    early_head = False  # the first byte at the first token, as the proxy sees it

    def __init__(
        self,
        engines: Sequence[LLMEngine],
        settings: Settings,
        clock: Callable[[], float],
        no_events: int = 0,
        roles: Sequence[str] = (),
    ) -> None:
        """``no_events``: the first that many workers publish no events (approximate ranks,
        fed by what the placer sends them: ``Placer.sent`` writes this index itself);
        ``roles``: each worker's role (``prefill``, ``decode``, ``both``: all ``both`` if
        empty), as the router's worker table would say (:mod:`kvrouter.replay.pd_policy`)."""
        super().__init__(engines)
        if settings.scoring.seed is None:  # a tempered first choice must replay the same way
            settings = msgspec.structs.replace(
                settings, scoring=msgspec.structs.replace(settings.scoring, seed=0)
            )
        # the worker table and the index the Placer reads: the replay feeds both (the index
        # from the engines' events), so nothing here opens a socket
        fleet = Registry(settings.health, clock=clock)
        self.index = PrefixIndex(settings.block_size)
        # as the service: each rank capped at its KV capacity (which the health checks read from
        # the worker's /metrics, here from the engine itself), that the scoring also reads
        self.index.set_rank_caps(settings.index.max_rank_entries, settings.index.capacity_margin)
        self.placer = Placer(PlacementSettings.of(settings), self.index, fleet, clock=clock)
        self.keys = []
        self.deaf = set(range(no_events))
        for w, engine in enumerate(engines):
            events = EVENTS_NONE if w in self.deaf else "tcp://127.0.0.1:9"  # never dialled
            role = roles[w] if roles else "both"
            cfg = WorkerConfig(
                id=f"w{w}", url=f"http://w{w}.invalid", events_endpoint=events, role=role
            )
            fleet.add(cfg)
            self.index.add_worker(cfg.id, 0, model=cfg.model)
            self.index.set_approximate((cfg.id, 0), cfg.approximate)
            self.index.set_rank_capacity((cfg.id, 0), {"GPU": engine.bm.num_blocks})
            self.keys.append((cfg.id, 0))
        self._slot = {k: w for w, k in enumerate(self.keys)}
        self.looplog = LoopLog()
        watch_loop(self.placer, self.looplog, clock)

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        d = self.placer.place(tokens)
        best = d.order[0]
        if self.early_head:  # the picker's flight, seeing the head at once and no first token
            flight = self.placer.fly(d, best, "epp", endpoint="completions", by_events=True)
            flight.head()
        else:
            flight = self.placer.fly(d, best, "proxy", endpoint="completions")
        return self._slot[d.candidates[best].key], flight

    def first_token(self, handle: Any, now: float) -> None:
        if not self.early_head:
            handle[1].first_byte()

    def finish(self, handle: Any, now: float, cached: int | None = None) -> None:
        super().finish(handle, now)
        flight = handle[1]
        if cached is not None:  # as the proxy reads the answer's usage: the loop judges it
            flight.cached = cached
        flight.done("200")

    def close(self) -> None:
        loop = self.placer.loop
        self.looplog.verdicts = {key[0]: loop.verdict(key[0]) for key in self.keys}

    def events(self, worker: int, events: Sequence[Event], now: float) -> None:
        if worker in self.deaf:  # it publishes none: its tree is what was sent there
            return
        key, apply = self.keys[worker], self.index.apply_event
        for ev in events:
            apply(key, ev)
        self.placer.blocks_stored(key)


class KvrouterEarlyHeadPolicy(KvrouterPolicy):
    """``kvrouter-early-head`` (see the module docstring)."""

    name = "kvrouter-early-head"
    early_head = True


class CacheAwarePolicy(Policy):
    """sglang-router's cache_aware rule (see the module docstring)."""

    name = "cache_aware"
    CACHE_THRESHOLD = 0.3
    BALANCE_ABS = 64
    BALANCE_REL = 1.5

    def __init__(self, engines: Sequence[LLMEngine]) -> None:
        super().__init__(engines)
        self.trees: list[set[int]] = [set() for _ in engines]

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        hashes = self.engines[0].bm.hash_blocks_of(tokens)
        load = self.outstanding
        lo, hi = min(load), max(load)
        if hi - lo > self.BALANCE_ABS and hi > lo * self.BALANCE_REL:
            w = load.index(lo)
        else:
            matched = [leading_run(hashes, tree) for tree in self.trees]
            best = max(range(len(matched)), key=lambda i: (matched[i], -load[i]))
            if matched[best] * self.engines[0].bm.block_size > self.CACHE_THRESHOLD * len(tokens):
                w = best
            else:
                w = min(range(len(self.trees)), key=lambda i: len(self.trees[i]))
        self.trees[w].update(hashes)
        return w, None


class OraclePolicy(Policy):
    """Least modeled TTFT over the engines' exact state (see the module docstring)."""

    name = "oracle"

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        bm0 = self.engines[0].bm
        bs = bm0.block_size
        hashes = bm0.hash_blocks_of(tokens[: len(tokens) - 1])  # one token is always computed
        best, best_t = 0, float("inf")
        for w, engine in enumerate(self.engines):
            t = modeled_ttft(engine, len(tokens) - len(engine.bm.lookup(hashes)) * bs)
            if t < best_t:
                best, best_t = w, t
        return best, None


def modeled_ttft(engine: LLMEngine, new_tokens: int) -> float:
    """Seconds until a request needing ``new_tokens`` of prefill gets its first token on
    ``engine``: the prefill queued ahead of it and its own, in steps of the token budget, each
    step also paying for the batch's decodes (the sim runner's timing model)."""
    runner = engine.runner
    assert isinstance(runner, SimRunner)
    sched = engine.scheduler
    queued = decoding = context = 0
    for seq in sched.running:
        left = seq.num_prompt_tokens - seq.num_computed_tokens
        if left > 0:
            queued += left
        else:
            decoding += 1
            context += seq.num_computed_tokens
    for seq in sched.waiting:
        queued += seq.num_prompt_tokens - seq.num_computed_tokens
    budget = max(1, sched.max_num_batched_tokens - decoding)
    total = queued + new_tokens
    steps = -(-total // budget)
    p = runner.p
    ms = steps * (p["prefill_c"] + (runner.decode_ms(decoding, context) if decoding else 0.0))
    ms += p["prefill_b"] * total + p["prefill_a"] * min(new_tokens, budget) * new_tokens
    return ms / 1e3
