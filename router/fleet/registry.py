"""The worker registry: which workers exist (static config + ``POST /workers``), whether each is
healthy, which models it serves, its scraped load, and the derived views the router needs per
request (candidate ranks per model, EXTERNAL pool groups). Event-loop-only.

Health is active (``GET {url}{health.path}`` every ``health.interval_s``; ``unhealthy_after``
consecutive failures mark a worker down, one success brings it back) and passive (the proxy
reports a connection failure, which marks the worker down at once). Checks go through the
proxy's lean HTTP client, one worker at a time spread over the interval: a burst of them on the
event loop would stall the placements waiting behind it (measured: p99 of ``/route`` doubled). A new worker starts healthy
so it can take traffic before the first check. The router only ever calls these registered URLs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable

import msgspec

from indexer.index import WorkerKey
from router.errors import NotFound
from router.scoring import ScrapedLoad, worker_hash
from router.settings import HealthSettings, WorkerConfig
from router.upstream import UpstreamError, UpstreamPool

__all__ = ["Registry", "WorkerState", "parse_load_metrics"]

log = logging.getLogger("kvrouter.registry")
_REDISCOVER_S = 30.0

# name -> field of ScrapedLoad; values of one name are summed over label sets
_LOAD_METRICS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
}


def parse_load_metrics(text: str) -> ScrapedLoad | None:
    """vLLM / SGLang load gauges from Prometheus text; ``None`` if none is present."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        if end <= 0:
            continue
        field = _LOAD_METRICS.get(line[:end])
        if field is None:
            continue
        value_part = line[line.rfind("}") + 1 :] if brace >= 0 else line[end:]
        try:
            value = float(value_part.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            found[field] = found.get(field, 0.0) + value
    if not found:
        return None
    return ScrapedLoad(
        running=found.get("running", 0.0),
        waiting=found.get("waiting", 0.0),
        kv_usage=min(1.0, found.get("kv_usage", 0.0)),
    )


class _ModelList(msgspec.Struct):
    class _Model(msgspec.Struct):
        id: str

    data: list[_Model]


_decode_models = msgspec.json.Decoder(_ModelList).decode


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

    async def check(self, http: UpstreamPool, st: WorkerState) -> None:
        timeout = self.health.timeout_s
        try:
            status, _ = await http.get(st.url, self.health.path, timeout)
            ok = status < 300
            err = f"health check answered {status}"
        except UpstreamError as e:
            ok, err = False, f"health check failed: {e!r}"
        st.last_check = time.time()
        if self.workers.get(st.id) is not st:
            return  # removed while we were waiting
        if not ok:
            self.mark_failure(st.id, err)
            return
        self.mark_success(st.id)
        if not st.config.model and not st.discovered_models:
            now = self.clock()
            if now - st.discovery_at >= _REDISCOVER_S:  # a worker without /v1/models: not
                st.discovery_at = now  # asked again every round
                await self._discover_models(http, st)
        if self.scrape_metrics:
            try:
                status, body = await http.get(st.url, "/metrics", timeout)
                if status == 200:
                    st.scraped = parse_load_metrics(body.decode("utf-8", "replace"))
            except UpstreamError as e:
                log.debug("scraping %s/metrics failed: %r", st.url, e)

    async def _discover_models(self, http: UpstreamPool, st: WorkerState) -> None:
        try:
            status, body = await http.get(st.url, "/v1/models", self.health.timeout_s)
            if status == 200:
                st.discovered_models = frozenset(m.id for m in _decode_models(body).data)
        except (UpstreamError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.debug("model discovery on %s failed: %r", st.url, e)

    async def check_all(self, http: UpstreamPool) -> None:
        states = list(self.workers.values())
        for st in states:
            st.discovery_at = -math.inf  # asked for: look again now
        if states:
            await asyncio.gather(*(self.check(http, st) for st in states))

    async def run(self, http: UpstreamPool) -> None:
        """The health-check loop; cancelled by the app's lifespan. Each worker is checked once
        per interval, the checks spread evenly over it (each in its own task, so a worker that
        times out delays no other)."""
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                states = list(self.workers.values())
                if not states:
                    await asyncio.sleep(self.health.interval_s)
                    continue
                gap = self.health.interval_s / len(states)
                for st in states:
                    if self.workers.get(st.id) is st:
                        task = asyncio.ensure_future(self._check_logged(http, st))
                        running.add(task)
                        task.add_done_callback(running.discard)
                    await asyncio.sleep(gap)
        finally:
            for task in running:
                task.cancel()

    async def _check_logged(self, http: UpstreamPool, st: WorkerState) -> None:
        try:
            await self.check(http, st)
        except Exception:  # a bug here must not end health checking for good
            log.exception("health check of %s failed", st.id)

    def events_stale(self, st: WorkerState, since_last_event: float | None) -> bool:
        """Took traffic lately but published no event for ``stale_events_s``: its index view
        is probably frozen (events misconfigured or lost), so placements on it are guesses."""
        limit = self.health.stale_events_s
        if st.last_routed_at is None or self.clock() - st.last_routed_at > limit:
            return False
        return since_last_event is None or since_last_event > limit

    def states(self) -> Iterable[WorkerState]:
        return self.workers.values()
