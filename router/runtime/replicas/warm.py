"""Warm start from a peer replica (docs/architecture.md §9): before the runtime is built, fetch a
peer's index snapshot (``GET /admin/snapshot``, admin-keyed: the format of
:mod:`indexer.index.snapshot`, with each worker rank's last applied sequence number) and start
from it; the subscriber then resumes every rank's stream from those numbers (checking first that
the publisher is still the process they came from), so the replica routes with the fleet's cache
from its first request instead of after the workers' replays. Peers are tried in order, all
within ``replicas.warm_timeout_s``; when none answers with a usable snapshot the start is cold,
as without peers. :meth:`router.runtime.Runtime.log_time_to_ready` says how long either took,
and :meth:`router.runtime.Runtime.drop_unclaimed` drops the restored ranks no worker claims.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from indexer.index import PrefixIndex, SnapshotError
from router.fleet.upstream import UpstreamError, UpstreamPool
from router.runtime.replicas.errors import WarmStartError
from router.settings import Settings
from router.types import WorkerKey

__all__ = [
    "SNAPSHOT_PATH",
    "SNAPSHOT_TYPE",
    "WarmIndex",
    "fetch_index",
    "warm_index",
]

log = logging.getLogger("kvrouter.replicas")

SNAPSHOT_PATH = "/admin/snapshot"
SNAPSHOT_TYPE = "application/vnd.kvrouter.index-snapshot+msgpack"


@dataclasses.dataclass(frozen=True)
class WarmIndex:
    index: PrefixIndex
    seqs: dict[WorkerKey, int]  # resume points (indexer.events.ResumePoint)
    source: str  # the peer's URL


async def fetch_index(
    pool: UpstreamPool, url: str, admin_key: str | None, block_size: int, max_bytes: int
) -> WarmIndex:
    """One peer's index; :class:`WarmStartError` for any answer that is not a usable one."""
    headers = [("authorization", f"Bearer {admin_key}")] if admin_key else []
    try:
        resp = await pool.request(url, "GET", SNAPSHOT_PATH, headers, b"")
        try:
            if resp.status_code != 200:
                raise WarmStartError(f"HTTP {resp.status_code}")
            data = await resp.read(max_bytes)
        finally:
            await resp.aclose()
    except UpstreamError as e:
        raise WarmStartError(str(e)) from e
    try:  # (off the loop: a large index takes a while to decode, and nothing else reads it)
        index, seqs = await asyncio.to_thread(PrefixIndex.from_snapshot_bytes, data)
    except (SnapshotError, ValueError, KeyError, TypeError, IndexError) as e:
        raise WarmStartError(f"not a usable index snapshot: {e}") from e
    if index.block_size != block_size:
        raise WarmStartError(f"block size {index.block_size}, not {block_size}")
    return WarmIndex(index, seqs, url)


async def warm_index(settings: Settings, urls: Sequence[str]) -> WarmIndex | None:
    """The first usable index of ``urls``' peers, or None (a cold start)."""
    if not urls:
        return None
    rs = settings.replicas
    t0 = time.monotonic()
    deadline = t0 + rs.warm_timeout_s
    pool = UpstreamPool(
        connect_s=min(2.0, rs.warm_timeout_s),  # a peer that is down is skipped quickly
        read_s=rs.warm_timeout_s,
        write_s=rs.warm_timeout_s,
        max_body_bytes=rs.max_snapshot_bytes,
        ca_file=settings.proxy.ca_file,
    )
    try:
        for url in urls:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            fetch = fetch_index(
                pool, url, settings.admin_key, settings.block_size, rs.max_snapshot_bytes
            )
            try:
                got = await asyncio.wait_for(fetch, left)
            except (asyncio.TimeoutError, WarmStartError) as e:
                log.warning("warm start: %s gave no index: %s", url, e or "timed out")
                continue
            log.info(
                "warm start: index of %d blocks on %d worker ranks from %s in %.2f s",
                len(got.index),
                len(got.index.workers()),
                url,
                time.monotonic() - t0,
            )
            return got
    finally:
        await pool.aclose()
    log.warning(
        "warm start: no peer of %s gave an index within %g s: starting cold (the workers' replays)",
        list(urls),
        rs.warm_timeout_s,
    )
    return None
