"""Faults in the replay (issue 36): KV events that go wrong without a sequence gap, so the index
is wrong and nothing but the workers' own cached-token reports can say so. Modeled here in virtual
time; live, the same flags put a ZMQ relay on the faulty engines' path to a real router
(:mod:`kvrouter.replay.relay`), which spoils their events as below.

* ``--fault-drop P:K``: the last K workers silently lose each KV event with probability P (the
  index misses stores and removals alike);
* ``--fault-restart K``: the last K workers clear their prefix cache mid-run (at the first
  arrival past the middle of the slice's span) and publish no ``AllBlocksCleared``;
* ``--fault-seed K``: the last K workers hash with another seed: the router never computes the
  keys of what their events store (the replay salts the token ids of their stores, the one thing
  the index chains its keys from), so their events never match a prompt.

The faulty path is between the engine and the router: the engines themselves run as ever, and
report their real prefix-cache hit with every answer (``o.num_cached_tokens``, whole blocks, as
vLLM's ``cached_tokens``), which the closed loop (:mod:`router.placement.loop`, ``--loop``)
judges. Its switch is the index's own (``PrefixIndex.set_approximate``: the replay applies
events to the index itself, so it is the index's one writer; a worker turned for lost stores
keeps what its events held as its tree's seed, as in the router); back on events, the rank takes a
fresh stream as the subscriber asks the worker's replay endpoint for one: every batch the worker
published that has reached the router by then (the replay socket is not the faulty path, but a
worker's seed is its own; a silently restarted publisher holds only what it published since),
then the live events on. The bundled engine's replay buffer keeps the last 10,000 batches; here
it keeps all. :class:`LoopLog` records each turn for the report.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.engine import LLMEngine
from indexer.events import BlockStored, Event
from router.settings import Settings
from router.types import WorkerKey

__all__ = [
    "SALT",
    "FaultInjector",
    "Faults",
    "LoopLog",
    "add_fault_arguments",
    "faults_of",
    "loop_settings",
    "row_suffix",
    "salted",
    "watch_loop",
]

#: what the seed fault adds to every token id its workers' stores carry
SALT = 1 << 40


@dataclass(frozen=True)
class Faults:
    drop_p: float = 0.0
    drop_k: int = 0
    restart_k: int = 0
    seed_k: int = 0
    #: the closed loop on (the router's default) or off
    loop: bool = True

    def label(self, router: bool = True) -> str:
        """The run's row suffix: the faults and, for a policy that is the router (``router``),
        the loop's state ("" for the default)."""
        parts = []
        if self.drop_k and self.drop_p > 0:
            parts.append(f"drop {self.drop_p:.0%} x{self.drop_k}")
        if self.restart_k:
            parts.append(f"restart x{self.restart_k}")
        if self.seed_k:
            parts.append(f"seed x{self.seed_k}")
        if not router:
            return f" [{', '.join(parts)}]" if parts else ""
        if not parts and self.loop:
            return ""
        return f" [{', '.join(parts) or 'no fault'}; loop {'on' if self.loop else 'off'}]"


def add_fault_arguments(group: Any) -> None:
    """The fault flags (both modes) on the replay's fleet argument group."""
    a = group.add_argument
    a("--fault-drop", metavar="P:K", help="the last K workers silently lose a fraction P of "
      "their KV events (no sequence gap)")  # fmt: skip
    a("--fault-restart", type=int, default=0, metavar="K",
      help="the last K workers clear their cache mid-run, unannounced")  # fmt: skip
    a("--fault-seed", type=int, default=0, metavar="K",
      help="the last K workers hash with another seed: their events never match")  # fmt: skip
    a("--loop", choices=("on", "off"), default="on", help="the closed loop (default on)")


def faults_of(args: argparse.Namespace) -> Faults:
    drop_p, drop_k = 0.0, 0
    if args.fault_drop:
        p, _, k = args.fault_drop.partition(":")
        try:
            drop_p, drop_k = float(p), int(k)
        except ValueError:
            raise ValueError(f"--fault-drop takes P:K, got {args.fault_drop!r}") from None
        if not 0 <= drop_p <= 1:
            raise ValueError(f"--fault-drop: P must be in [0, 1], got {drop_p}")
    n = args.workers
    for flag, k in (("drop", drop_k), ("restart", args.fault_restart), ("seed", args.fault_seed)):
        if not 0 <= k <= n:
            raise ValueError(f"--fault-{flag}: K must be in [0, {n}], got {k}")
    return Faults(drop_p, drop_k, args.fault_restart, args.fault_seed, args.loop == "on")


class FaultInjector:
    """One run's faulty path: ``events`` filters what a worker published before the router
    hears it; ``arrive`` restarts the chosen workers' caches once, mid-run."""

    def __init__(self, faults: Faults, workers: int, restart_at: float, seed: int) -> None:
        self.faults = faults
        self.drop = set(range(workers - faults.drop_k, workers)) if faults.drop_p > 0 else set()
        self.seeded = set(range(workers - faults.seed_k, workers))
        self.restart = list(range(workers - faults.restart_k, workers))
        self.restart_at = restart_at
        self.rng = random.Random(seed)
        #: events each faulty worker lost
        self.dropped: Counter[int] = Counter()
        #: per worker, what its publisher holds for replay: (when it reaches the router, batch)
        self.published: dict[int, list[tuple[float, list[Event]]]] = {}

    def events(self, w: int, events: list[Event], at: float) -> list[Event]:
        """Worker ``w`` published ``events``, which reach the router at ``at``: what does."""
        self.published.setdefault(w, []).append((at, events))
        if w in self.drop:
            p, rng, kept = self.faults.drop_p, self.rng, []
            for ev in events:
                if rng.random() < p:
                    self.dropped[w] += 1
                else:
                    kept.append(ev)
            events = kept
        if w in self.seeded:
            events = [salted(ev) if type(ev) is BlockStored else ev for ev in events]
        return events

    def arrive(self, now: float, engines: Sequence[LLMEngine]) -> None:
        if self.restart and now >= self.restart_at:
            for w in self.restart:
                engines[w].reset_prefix_cache()
                engines[w].drain_events()  # its AllBlocksCleared never leaves the worker
                self.published.pop(w, None)  # (a new publisher: nothing to replay from before)
            self.restart = []

    def replay(self, w: int, now: float) -> list[Event]:
        """A fresh stream of worker ``w`` at ``now``: every batch it published that has reached
        the router (those still on the way come live), through its own seed only."""
        out = [ev for at, batch in self.published.get(w, ()) if at <= now for ev in batch]
        return (
            [salted(ev) if type(ev) is BlockStored else ev for ev in out]
            if (w in self.seeded)
            else out
        )

    def attach(self, policy: Any, clock: Callable[[], float]) -> None:
        """Policy kvrouter (one router): a worker its loop sends back to its events takes a
        fresh stream (``LoopLog.fresh``)."""
        log = getattr(policy, "looplog", None)
        if log is not None:
            log.fresh = lambda w: policy.events(w, self.replay(w, clock()), clock())


def loop_settings(settings: Settings, faults: Faults) -> Settings:
    """``settings`` with the closed loop as ``faults.loop`` says."""
    if settings.agreement.enabled == faults.loop:
        return settings
    agreement = msgspec.structs.replace(settings.agreement, enabled=faults.loop)
    return msgspec.structs.replace(settings, agreement=agreement)


def salted(ev: BlockStored) -> BlockStored:
    """A store as a worker hashing with another seed publishes it (the seed fault, both modes)."""
    return msgspec.structs.replace(ev, token_ids=[t + SALT for t in ev.token_ids])


@dataclass
class LoopLog:
    """The loop's turns as the replay saw them: (worker, to approximate, its answers judged so
    far, the verdict's kind and likely cause, simulated time)."""

    turns: list[tuple[str, bool, int, str, str, float]] = field(default_factory=list)
    #: answers reporting cached tokens, per worker: the loop's own count (``watch_loop``)
    answers: Counter[str] = field(default_factory=Counter)
    #: each worker's standing at the run's end (``AgreementLoop.verdict``)
    verdicts: dict[str, dict[str, object]] = field(default_factory=dict)
    #: applies worker ``w``'s fresh stream to the index (None: rebuilt from the live events on)
    fresh: Callable[[int], object] | None = None

    def columns(self) -> dict[str, Any]:
        """The report's column: each worker's first turn, ``w7@23 worker_ahead``."""
        first: dict[str, str] = {}
        for worker, on, n, kind, _, _ in self.turns:
            if on and worker not in first:
                first[worker] = f"{worker}@{n} {kind}"
        return {"turned": " ".join(first.values()) or "-"}


def watch_loop(placer: Any, log: LoopLog, clock: Any) -> None:
    """Record each switch of ``placer.loop`` (the index's own switch, still the one applied)."""
    loop, switch = placer.loop, placer.loop.switch
    log.answers = loop.answers

    def recorded(key: WorkerKey, on: bool, keep: bool) -> object:
        verdict = loop.turned[key[0]][0] if on else loop.estimator.verdict(key[0])
        log.turns.append((key[0], on, log.answers[key[0]], verdict.kind, verdict.likely, clock()))
        switch(key, on, keep)
        if not on and log.fresh is not None:
            log.fresh(int(key[0][1:]))  # (the replay's workers are w0, w1, ...)
        return None

    loop.switch = recorded


def row_suffix(faults: Faults, no_events: int, workers: int, router: bool) -> str:
    """A live row's suffix: its fleet's faults (every policy's: a restart is the engines') and,
    on a router that reads events (``router``), its workers without any and its loop."""
    mixed = f" [{no_events} of {workers} without events]" if no_events else ""
    return mixed + faults.label(router=router)
