"""The health task's end (router.fleet.health): it returns only once every check it started has
ended, so the app can close the checks' client after it."""

from __future__ import annotations

import asyncio

import pytest

from router.fleet.health import HealthChecker
from router.fleet.registry import Registry
from router.settings.config import HealthSettings
from router.settings.workers import WorkerConfig


class CancelSwallowingPool:
    """Stands in for UpstreamPool at the one seam no real part reaches on demand: its first call
    finishes even when cancelled, as Python 3.11's ``asyncio.wait_for`` (inside the real
    ``get``) can when a cancel lands as the call completes. Each call ends a few loop turns
    after it is free to."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.ended: list[str] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def get(self, base_url: str, path: str, timeout_s: float) -> tuple[int, bytes]:
        self.started.append(path)
        if path == "/health":
            self.entered.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                await self.release.wait()  # the cancel is lost; the call completes
        for _ in range(5):
            await asyncio.sleep(0)
        self.ended.append(path)
        return 200, b""


async def test_the_health_task_ends_after_the_checks_it_started() -> None:
    registry = Registry(HealthSettings(interval_s=60.0, scrape_metrics=True))
    registry.add(WorkerConfig(id="w", url="http://127.0.0.1:9", model="m"))
    pool = CancelSwallowingPool()
    checker = HealthChecker(registry, pool, capacity_every_s=3600.0)  # type: ignore[arg-type]
    task = asyncio.create_task(checker.run())
    await asyncio.wait_for(pool.entered.wait(), 5)
    task.cancel()
    pool.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the check went on to scrape /metrics; the health task waited for it to end
    assert pool.started == ["/health", "/metrics"] and pool.ended == ["/health", "/metrics"]
