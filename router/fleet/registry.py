"""The worker table: which workers exist (static config, ``POST /workers``, discovery), whether
each is healthy, which models it serves, its scraped load, and the views placement reads per
request (candidate workers per model, EXTERNAL pool groups). Pure state, event-loop-only: it does
no I/O — :mod:`router.fleet.health` checks the workers and writes their health here, and the
placement core reads it through :class:`router.placement.ports.FleetView`.

A worker has a role (``WorkerConfig.role``: ``prefill``, ``decode`` or ``both``, the default);
index, load and health stay per worker whatever its role. :meth:`Registry.lacking_roles` is the
readiness rule of a fleet with roles (``/ready``).

A new worker starts healthy so it can take traffic before the first check. Health is active (the
checker: ``unhealthy_after`` consecutive failures mark a worker down, one success brings it back)
and passive (the proxy reports a connection failure, which marks the worker down at once).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

from router.errors import NotFound
from router.settings import HealthSettings, WorkerConfig
from router.types import ScrapedLoad, WorkerKey, worker_hash

__all__ = ["Registry", "WorkerState"]

log = logging.getLogger("kvrouter.registry")


class WorkerState:
    def __init__(self, config: WorkerConfig, *, dynamic: bool = False) -> None:
        self.config = config
        self.dynamic = dynamic
        self.healthy = True
        self.failures = 0
        self.last_check: float | None = None
        self.last_error: str | None = None
        self.discovered_models: frozenset[str] = frozenset()
        self.discovery_at = -math.inf  # monotonic time of the last /v1/models attempt
        self.scraped: ScrapedLoad | None = None
        #: KV capacity per rank (engine blocks per tier; None: not reported), from ``/metrics``
        self.kv_capacity: list[dict[str, int] | None] | None = None
        self.capacity_at = -math.inf  # monotonic time of the last capacity scrape
        self.last_routed_at: float | None = None  # monotonic
        self.keys: list[WorkerKey] = [(config.id, r) for r in range(config.dp_ranks)]
        self.key_hashes = [worker_hash(k) for k in self.keys]

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def url(self) -> str:
        return self.config.base_url

    def models(self) -> frozenset[str]:
        """Served model names: the configured one, else what ``/v1/models`` said (may be empty)."""
        if self.config.model:
            return frozenset((self.config.model,))
        return self.discovered_models

    def serves(self, model: str | None) -> bool:
        if not model:
            return True
        names = self.models()
        # a worker whose models are not known yet takes any name rather than none
        return not names or model in names


class Registry:
    def __init__(
        self,
        health: HealthSettings,
        *,
        scrape_metrics: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.health = health
        self.clock = clock  # monotonic seconds; the simulated clock in virtual-time replay
        self.scrape_metrics = scrape_metrics or health.scrape_metrics
        self.workers: dict[str, WorkerState] = {}
        self._pools: list[list[WorkerKey]] = []
        self.version = 0  # bumped on every membership change

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self.workers

    def add(self, config: WorkerConfig, *, dynamic: bool = False) -> WorkerState:
        st = WorkerState(config, dynamic=dynamic)
        self.workers[config.id] = st
        self._changed()
        return st

    def remove(self, worker_id: str) -> WorkerState | None:
        st = self.workers.pop(worker_id, None)
        if st is not None:
            self._changed()
        return st

    def _changed(self) -> None:
        self.version += 1
        groups: dict[str, list[WorkerKey]] = {}
        for st in self.workers.values():
            if st.config.pool:
                groups.setdefault(st.config.pool, []).extend(st.keys)
        self._pools = [g for g in groups.values() if len(g) > 1]

    def pools(self) -> list[list[WorkerKey]]:
        return self._pools

    def known_models(self) -> set[str]:
        out: set[str] = set()
        for st in self.workers.values():
            out |= st.models()
        return out

    def candidates(self, model: str | None) -> list[WorkerState]:
        """Workers that may serve ``model``; :class:`NotFound` when no worker knows it."""
        if not model:
            return list(self.workers.values())
        out = [st for st in self.workers.values() if st.serves(model)]
        if not out and self.workers:
            raise NotFound(f"model {model!r} is not served by any worker")
        return out

    def mark_failure(self, worker_id: str, error: str, *, now: bool = False) -> None:
        st = self.workers.get(worker_id)
        if st is None:
            return
        st.failures += 1
        st.last_error = error
        if now or st.failures >= self.health.unhealthy_after:
            if st.healthy:
                log.warning("worker %s marked unhealthy: %s", worker_id, error)
            st.healthy = False

    def mark_success(self, worker_id: str) -> None:
        st = self.workers.get(worker_id)
        if st is None:
            return
        if not st.healthy:
            log.info("worker %s healthy again", worker_id)
        st.failures = 0
        st.healthy = True
        st.last_error = None

    def events_stale(self, st: WorkerState, since_last_event: float | None) -> bool:
        """Took traffic lately but published no event for ``stale_events_s``: its index view
        is probably frozen (events misconfigured or lost), so placements on it are guesses."""
        limit = self.health.stale_events_s
        if st.config.approximate:  # it publishes none: nothing to go stale
            return False
        if st.last_routed_at is None or self.clock() - st.last_routed_at > limit:
            return False
        return since_last_event is None or since_last_event > limit

    def lacking_roles(self, stream_live: Callable[[str], bool]) -> list[str]:
        """What a fleet with roles lacks to serve a request now (``[]``: nothing), a worker
        being *routable* when healthy and ``stream_live(id)`` (its event stream replayed and
        live): a routable worker that decodes (``decode`` or ``both``), ``"decode"`` else; and
        when the fleet has ``prefill`` workers but no ``both`` one, a routable ``prefill``
        worker, ``"prefill"`` else. A fleet of ``both`` workers only (or none) lacks nothing
        here: its readiness is the one rule of any fleet (some routable worker), unchanged."""
        roles = {st.config.role for st in self.workers.values()}
        if roles <= {"both"}:
            return []
        routable = {
            st.config.role for st in self.workers.values() if st.healthy and stream_live(st.id)
        }
        lacking = []
        if not routable & {"decode", "both"}:
            lacking.append("decode")
        if "prefill" in roles and "both" not in roles and "prefill" not in routable:
            lacking.append("prefill")
        return lacking

    def states(self) -> Iterable[WorkerState]:
        return self.workers.values()
