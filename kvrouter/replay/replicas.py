"""Router replicas in virtual time: policy ``kvrouter`` placed through R routers, as behind one
Service (``kvrouter replay --router-replicas R --replica-sync on|off --sync-delay-ms D``).

Each replica is a whole :class:`kvrouter.replay.policies.KvrouterPolicy`: its own
:class:`router.placement.Placer` with its own predicted blocks, load ledger and remote tickets,
its own worker table, and its own :class:`indexer.index.PrefixIndex` fed by every engine's
events (each real replica subscribes to every worker). The indexes are not shared although they
hold the same blocks: with rank caps on, a match leaves recency marks that steer the index's
eviction, and a real replica only marks what *it* matched.

A request goes to a replica drawn at random (seeded), as a Service's kube-proxy picks a backend
per connection, one request per connection. With sync on, each replica's placer tells a
:class:`router.placement.EventLog` its tickets' lives (committed, first token, ended); after each
of its calls the log is taken and delivered to every other replica's
:meth:`router.placement.RemoteTickets.apply` ``delay_s`` later on the simulated clock — without
sync, never. Synced replicas hear each other, so each takes its lane: its place among them, as
:class:`router.runtime.replicas.ReplicaSync` derives it from the origins it hears. Delivery is
applied lazily, just before the next placement at or after its due time (the first moment remote
state can change a decision), so a remote ticket's TTL and its predictions' start then: late by
at most the gap between two arrivals, against TTLs of seconds.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.engine import LLMEngine
from indexer.events import Event
from kvrouter.replay.policies import KvrouterPolicy, Policy
from router.placement import EventLog, RemoteEvent
from router.settings import Settings

__all__ = ["ReplicatedKvrouterPolicy", "RouterReplicas", "replica_runs"]


@dataclass(frozen=True)
class RouterReplicas:
    """How many routers place policy ``kvrouter``'s requests, and whether they sync."""

    count: int = 1
    sync: bool = True
    #: simulated seconds from a replica's placement event to its peers applying it
    delay_s: float = 0.005

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"--router-replicas must be at least 1, got {self.count}")
        if self.delay_s < 0:
            raise ValueError(f"--sync-delay-ms must not be negative, got {self.delay_s * 1e3}")

    @property
    def label(self) -> str:
        """The table's row name: ``kvrouter`` for one router."""
        if self.count == 1:
            return "kvrouter"
        return f"kvrouter ({self.count} replicas, {'sync' if self.sync else 'no sync'})"


def replica_runs(args: Any) -> list[RouterReplicas]:
    """Policy kvrouter's runs from ``kvrouter replay``'s arguments: one router, then
    (``--router-replicas`` > 1) R of them, synced, not synced, or both (``--replica-sync``)."""
    one = RouterReplicas(1)
    if args.router_replicas == 1:
        return [one]
    syncs = {"on": [True], "off": [False], "both": [True, False]}[args.replica_sync]
    delay = args.sync_delay_ms / 1000
    return [one, *(RouterReplicas(args.router_replicas, s, delay) for s in syncs)]


class ReplicatedKvrouterPolicy(Policy):
    """Policy ``kvrouter`` through ``replicas.count`` routers (see the module docstring)."""

    def __init__(
        self,
        engines: Sequence[LLMEngine],
        settings: Settings,
        clock: Callable[[], float],
        replicas: RouterReplicas,
        seed: int,
    ) -> None:
        super().__init__(engines)
        self.name = replicas.label
        self.replicas = [KvrouterPolicy(engines, settings, clock) for _ in range(replicas.count)]
        self.sync = replicas.sync and replicas.count > 1
        if self.sync:  # a replica's lane is its place among the peers it hears
            for i, r in enumerate(self.replicas):
                r.placer.lane = (i, replicas.count)
        self.delay_s = replicas.delay_s
        self.logs: list[EventLog] = []
        if self.sync:
            for r in self.replicas:
                log = EventLog(settings.replicas.max_hashes)  # what the real glue sends
                r.placer.listener = log  # read by each commit and each flight fly() makes
                self.logs.append(log)
        self.rng = random.Random(seed)
        #: (due time, origin replica, its events), in due order: one delay, a monotonic clock
        self.pending: deque[tuple[float, int, list[RemoteEvent]]] = deque()
        self.delivered = 0

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        self._deliver(now)
        r = self.rng.randrange(len(self.replicas)) if len(self.replicas) > 1 else 0
        w, flight = self.replicas[r].choose(tokens, now)
        self._publish(r, now)
        return w, (r, flight)

    def first_token(self, handle: Any, now: float) -> None:
        r, flight = handle[1]
        flight.first_byte()
        self._publish(r, now)

    def finish(self, handle: Any, now: float, cached: int | None = None) -> None:
        super().finish(handle, now)
        r, flight = handle[1]
        flight.cached = cached  # (its replica's loop judges it)
        flight.done("200")
        self._publish(r, now)

    def events(self, worker: int, events: Sequence[Event], now: float) -> None:
        for r in self.replicas:  # every replica subscribes to every worker
            r.events(worker, events, now)

    def _publish(self, r: int, now: float) -> None:
        if self.sync:
            events = self.logs[r].take()
            if events:
                self.pending.append((now + self.delay_s, r, events))

    def _deliver(self, now: float) -> None:
        pending = self.pending
        while pending and pending[0][0] <= now:
            _, origin, events = pending.popleft()
            name = f"r{origin}"
            for r, replica in enumerate(self.replicas):
                if r != origin:
                    replica.placer.remote.apply(name, events)
            self.delivered += 1
