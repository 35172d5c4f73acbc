"""Warm start from a peer replica (docs/architecture.md §9): before the runtime is built, fetch a
peer's index snapshot (``GET /admin/snapshot`` with the peer key's token, or the admin key on a
trusted network: :func:`snapshot_credential`; the format of
:mod:`indexer.index.snapshot`, with each worker rank's last applied sequence number) and start
from it; the subscriber then resumes every rank's stream from those numbers (reconciling:
``indexer.subscriber.restored``), so the replica routes with the fleet's cache from its first
request instead of after the workers' replays. The body is read into one buffer of at most
``replicas.max_snapshot_bytes`` and decoded in a thread under a ``DecodeBudget`` (the index's
own cap in entries, the warm start's deadline, cancelled when it gives up). Peers are tried in
order, all within ``replicas.warm_timeout_s``; when none answers with a usable snapshot the
start is cold, as without peers. :meth:`router.runtime.Runtime.log_time_to_ready` says how long either took,
and :meth:`router.runtime.Runtime.drop_unclaimed` drops the restored ranks no worker claims.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from indexer.index import DecodeBudget, PrefixIndex, SnapshotError
from router.fleet.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from router.runtime.memory import default_index_cap
from router.runtime.replicas.errors import WarmStartError
from router.runtime.replicas.peerkey import PeerKey
from router.settings import Settings
from router.types import WorkerKey

__all__ = [
    "SNAPSHOT_PATH",
    "SNAPSHOT_TYPE",
    "WarmIndex",
    "fetch_index",
    "snapshot_credential",
    "snapshot_entries",
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


def snapshot_credential(settings: Settings) -> str | None:
    """What a warm start shows a peer's ``/admin/snapshot``: the peer key's token when
    ``replicas.peer_key_file`` is set (the admin key never leaves this replica), else, in the
    trusted-network mode, the admin key (None: neither)."""
    path = settings.replicas.peer_key_file
    if path is not None:
        return PeerKey.read(path).snapshot_token()
    return settings.admin_key


async def fetch_index(
    pool: UpstreamPool,
    url: str,
    credential: str | None,
    block_size: int,
    max_bytes: int,
    budget: DecodeBudget,
) -> WarmIndex:
    """One peer's index, decoded within ``budget``; :class:`WarmStartError` for any answer that
    is not a usable one. Cancelled (the warm start's timeout), it cancels the decode too."""
    headers = [("authorization", f"Bearer {credential}")] if credential else []
    try:
        resp = await pool.request(url, "GET", SNAPSHOT_PATH, headers, b"")
        try:
            if resp.status_code != 200:
                raise WarmStartError(f"HTTP {resp.status_code}")
            data = await _read_body(resp, max_bytes)
        finally:
            await resp.aclose()
    except UpstreamError as e:
        raise WarmStartError(str(e)) from e
    try:  # (off the loop: a large index takes a while to decode, and nothing else reads it)
        index, seqs = await asyncio.to_thread(PrefixIndex.from_snapshot_bytes, data, budget)
    except asyncio.CancelledError:
        # asyncio cannot stop a thread: the budget's flag does, at its next check (~50 ms),
        # instead of an index nobody waits for any more being built to the end
        budget.cancel()
        raise
    except SnapshotError as e:
        raise WarmStartError(f"not a usable index snapshot: {e}") from e
    if index.block_size != block_size:
        raise WarmStartError(f"block size {index.block_size}, not {block_size}")
    return WarmIndex(index, seqs, url)


async def _read_body(resp: UpstreamResponse, limit: int) -> bytearray:
    """The body in one buffer, never two copies of it: preallocated from its Content-Length,
    else grown in place (a chunked body); :class:`WarmStartError` past ``limit`` bytes."""
    declared = resp.header("content-length")
    n = int(declared) if declared is not None and declared.isdigit() else None
    if n is not None and n > limit:
        raise WarmStartError(f"snapshot of {n} bytes over max_snapshot_bytes ({limit})")
    buf = bytearray(n or 0)
    size = 0
    async for chunk in resp.iter_chunks():
        end = size + len(chunk)
        if end > (limit if n is None else n):
            raise WarmStartError(f"snapshot over {limit if n is None else n} bytes")
        if n is None:
            buf += chunk  # (a large bytearray grows by realloc: in place, not by a copy)
        else:
            buf[size:end] = chunk
        size = end
    if n is not None and size != n:
        raise WarmStartError(f"snapshot of {size} bytes, not its Content-Length {n}")
    return buf


def snapshot_entries(settings: Settings) -> int:
    """The decode budget's entries: the index's own cap (``max_index_entries``, else its share
    of memory), which the replica would evict down to anyway; without one, what the body could
    hold at 3 bytes an entry."""
    cap = settings.max_index_entries
    if cap is None:
        cap = default_index_cap(settings.index.memory_fraction)
    return cap or settings.replicas.max_snapshot_bytes // 3


async def warm_index(settings: Settings, urls: Sequence[str]) -> WarmIndex | None:
    """The first usable index of ``urls``' peers, or None (a cold start)."""
    if not urls:
        return None
    rs = settings.replicas
    credential = snapshot_credential(settings)
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
            # the decode stops at the warm start's deadline, also when nobody cancels it
            budget = DecodeBudget(snapshot_entries(settings), deadline)
            fetch = fetch_index(
                pool, url, credential, settings.block_size, rs.max_snapshot_bytes, budget
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
