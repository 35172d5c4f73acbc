"""Active health checks of the workers, and what they learn on the way: served models
(``GET /v1/models``), when scoring uses it the load a worker reports on its ``/metrics``, and,
whatever scoring uses, its KV capacity there (:mod:`router.fleet.capacity`; at most once per
``capacity_every_s``, handed on through ``on_capacity`` when it changed: the runtime passes it to
the index's writer). Writes what it finds into the worker table
(:class:`router.fleet.registry.Registry`).

Each worker is checked every ``health.interval_s`` (``GET {url}{health.path}``), one at a time,
spread over the interval: a burst of checks on the event loop would stall the placements waiting
behind it (measured: p99 of ``/route`` doubled). Checks go through the proxy's lean HTTP client,
and only ever call registered URLs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import msgspec

from router.fleet.capacity import parse_kv_capacity, rank_capacities
from router.fleet.registry import Registry, WorkerState
from router.fleet.upstream import UpstreamError, UpstreamPool
from router.types import ScrapedLoad

__all__ = ["HealthChecker", "parse_load_metrics"]

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


class HealthChecker:
    """Checks every worker of ``registry`` through ``http``; ``run`` is the app's health task."""

    def __init__(
        self,
        registry: Registry,
        http: UpstreamPool,
        *,
        capacity_every_s: float = 60.0,
        on_capacity: Callable[[WorkerState], None] | None = None,
    ) -> None:
        self.registry = registry
        self.settings = registry.health
        self.http = http
        self.capacity_every_s = capacity_every_s
        self.on_capacity = on_capacity

    async def check(self, st: WorkerState) -> None:
        timeout = self.settings.timeout_s
        try:
            status, _ = await self.http.get(st.url, self.settings.path, timeout)
            ok = status < 300
            err = f"health check answered {status}"
        except UpstreamError as e:
            ok, err = False, f"health check failed: {e!r}"
        st.last_check = time.time()
        if self.registry.workers.get(st.id) is not st:
            return  # removed while we were waiting
        if not ok:
            self.registry.mark_failure(st.id, err)
            return
        self.registry.mark_success(st.id)
        if not st.config.model and not st.discovered_models:
            now = self.registry.clock()
            if now - st.discovery_at >= _REDISCOVER_S:  # a worker without /v1/models: not
                st.discovery_at = now  # asked again every round
                await self._discover_models(st)
        now = self.registry.clock()
        capacity = now - st.capacity_at >= self.capacity_every_s
        if not (self.registry.scrape_metrics or capacity):
            return
        if capacity:
            st.capacity_at = now  # asked, answered or not: not again before the interval
        try:
            status, body = await self.http.get(st.url, "/metrics", timeout)
        except UpstreamError as e:
            log.debug("scraping %s/metrics failed: %r", st.url, e)
            return
        if status != 200:
            return
        text = body.decode("utf-8", "replace")
        if self.registry.scrape_metrics:
            st.scraped = parse_load_metrics(text)
        if capacity and self.registry.workers.get(st.id) is st:
            self._learn_capacity(st, text)

    def _learn_capacity(self, st: WorkerState, text: str) -> None:
        caps = rank_capacities(parse_kv_capacity(text), st.config.dp_ranks)
        if caps == st.kv_capacity:
            return
        st.kv_capacity = caps
        log.info("worker %s KV capacity per rank (engine blocks): %s", st.id, caps)
        if self.on_capacity is not None:
            self.on_capacity(st)

    async def _discover_models(self, st: WorkerState) -> None:
        try:
            status, body = await self.http.get(st.url, "/v1/models", self.settings.timeout_s)
            if status == 200:
                st.discovered_models = frozenset(m.id for m in _decode_models(body).data)
        except (UpstreamError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.debug("model discovery on %s failed: %r", st.url, e)

    async def check_all(self) -> None:
        states = list(self.registry.workers.values())
        for st in states:
            st.discovery_at = -math.inf  # asked for: look again now
        if states:
            await asyncio.gather(*(self.check(st) for st in states))

    async def run(self) -> None:
        """The health-check loop; cancelled by the app's lifespan. Each worker is checked once
        per interval, the checks spread evenly over it (each in its own task, so a worker that
        times out delays no other)."""
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                states = list(self.registry.workers.values())
                if not states:
                    await asyncio.sleep(self.settings.interval_s)
                    continue
                gap = self.settings.interval_s / len(states)
                for st in states:
                    if self.registry.workers.get(st.id) is st:
                        task = asyncio.ensure_future(self._check_logged(st))
                        running.add(task)
                        task.add_done_callback(running.discard)
                    await asyncio.sleep(gap)
        finally:
            # wait for the checks to end: the app closes their client next, and a check that
            # outlived it would open a new session nobody closes (Python 3.11's wait_for, inside
            # UpstreamPool.get, can drop a cancel that lands as its call completes)
            checks = list(running)
            for task in checks:
                task.cancel()
            await asyncio.gather(*checks, return_exceptions=True)

    async def _check_logged(self, st: WorkerState) -> None:
        try:
            await self.check(st)
        except Exception:  # a bug here must not end health checking for good
            log.exception("health check of %s failed", st.id)
