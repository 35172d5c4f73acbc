"""The router's runtime: the placement core and the I/O around it, for one app.

:class:`Runtime` is built by ``create_app``'s lifespan and owns the prefix index and its only
writer (the ZMQ subscriber task), the HTTP pool to the workers, the worker table and its health
checker, the Prometheus registry, the tokenizer, the :class:`router.placement.Placer` that
every front door calls, and the replica sync around it when ``replicas:`` turns it on
(:mod:`router.runtime.replicas`). It adds and removes workers (the table, the subscriber, the
placer's state, the metrics, together) and answers readiness. Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import msgspec
from prometheus_client import CollectorRegistry

from indexer.index import IndexError_, PrefixIndex
from indexer.subscriber import Subscriber, WorkerEndpoint
from router.errors import BadRequest, Conflict, NoHealthyWorker, NotFound
from router.fleet.health import HealthChecker
from router.fleet.pods import NoEventSource, PodNotUsable, fetch_sources, sources_to_endpoints
from router.fleet.registry import Registry, WorkerState
from router.fleet.upstream import UpstreamError, UpstreamPool
from router.observe.metrics import (
    RouterMetrics,
    StateCollector,
    WorkerSample,
    register_process_metrics,
)
from router.observe.replicas import ReplicaCollector
from router.observe.snapshot import SnapshotCollector
from router.placement import PlacementSettings, Placer
from router.runtime.memory import default_index_cap
from router.runtime.replicas import PeerKey, ReplicaSync, WarmIndex, peer_key
from router.runtime.tokenize import Tokenizer, byte_tokenizer_warning, make_tokenizer
from router.settings import EVENTS_NONE, Settings, WorkerConfig
from router.types import WorkerKey

__all__ = ["Runtime", "load_index", "snapshot_off_loop"]

log = logging.getLogger("kvrouter.router")

#: restored ranks that no worker source (the config, discovery) claims this long after the
#: start are dropped: their workers are gone
UNCLAIMED_GRACE_S = 60.0


def load_index(settings: Settings) -> tuple[PrefixIndex, dict[WorkerKey, int]]:
    """The snapshotted index when ``snapshot.path`` holds a usable one, else an empty index."""
    path = settings.snapshot.path
    if path and os.path.exists(path):
        try:
            index, seqs = PrefixIndex.restore(path)
        except (IndexError_, OSError, ValueError) as e:
            log.warning("index snapshot %s not loaded, starting empty: %s", path, e)
        else:
            if index.block_size == settings.block_size:
                log.info("index restored from %s (%d blocks)", path, len(index))
                return index, seqs
            log.warning(
                "index snapshot %s has block size %d, not %d: starting empty",
                path,
                index.block_size,
                settings.block_size,
            )
    return PrefixIndex(settings.block_size), {}


class Runtime:
    """``warm``: the index a peer replica handed over (:func:`router.runtime.replicas.
    warm_index`), used instead of ``snapshot.path``'s; ``process``: this process's index under
    ``server.processes``."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        warm: WarmIndex | None = None,
        process: int = 0,
    ) -> None:
        self.settings = settings
        self.clock = clock
        p = settings.proxy
        self.draining = False  # SIGTERM: /ready answers 503 while in-flight requests finish
        self._snapshot_lock = threading.Lock()
        #: the current span's trace headers for the worker, when tracing is on (router.edge.tracing)
        self.trace_headers: Callable[[], list[tuple[str, str]]] | None = None
        self.upstream = UpstreamPool(  # the proxy's hot path
            connect_s=p.connect_timeout_s,
            read_s=p.read_timeout_s,
            write_s=p.write_timeout_s,
            keepalive_s=p.keepalive_s,
            max_per_worker=p.max_connections,
            pool_wait_s=p.pool_timeout_s,
            max_body_bytes=p.max_response_bytes,
            ca_file=p.ca_file,
        )
        self.index, seqs = load_index(settings) if warm is None else (warm.index, warm.seqs)
        ix = settings.index
        cap = settings.max_index_entries
        if cap is None:
            cap = default_index_cap(ix.memory_fraction)
        self.index.set_cap(cap)
        self.index.set_rank_caps(ix.max_rank_entries, ix.capacity_margin)
        log.info(
            "index cap: %s entries in all, %s per worker rank whose KV capacity is not known "
            "(else its capacity x %g)",
            f"{cap:,}" if cap else "no",
            f"{ix.max_rank_entries:,}" if ix.max_rank_entries else "no",
            ix.capacity_margin,
        )
        sc = settings.scoring
        self.registry = Registry(settings.health, scrape_metrics=sc.scrapes_metrics, clock=clock)
        self.health = HealthChecker(
            self.registry,
            self.upstream,
            capacity_every_s=ix.capacity_refresh_s,
            on_capacity=self._capacity_learned,
        )
        self.prom = CollectorRegistry(auto_describe=True)
        self.metrics = RouterMetrics(self.prom)
        self.placer = Placer(
            PlacementSettings.of(settings),
            self.index,
            self.registry,
            metrics=self.metrics,
            clock=clock,
        )
        self.subscriber = Subscriber(
            self.index,
            replay_timeout=settings.subscriber.replay_timeout_s,
            max_message_bytes=settings.subscriber.max_message_bytes,
            batch_window=settings.subscriber.batch_window_ms / 1000,
            on_applied=self.placer.blocks_stored,  # (events end the prefills they show built)
        )
        # what is sent to a worker without events enters its tree on the index's one writer
        self.placer.sent = self.subscriber.record_sent
        # and the closed loop's switch of a worker between its events and that tree too
        self.placer.loop.switch = self.subscriber.set_source
        if seqs:  # resume each worker rank after its snapshotted seq (replay closes the gap)
            self.subscriber.restore_seqs(seqs)
        self.prom.register(StateCollector(self._samples))  # (it reads the subscriber's stats)
        self.prom.register(SnapshotCollector(self.subscriber.snapshot_drops))
        register_process_metrics(self.prom)
        #: the replicas' shared key (None: none configured): ``/admin/snapshot`` takes its token
        self.peer_key: PeerKey | None = peer_key(settings.replicas)
        self.replicas: ReplicaSync | None = None  # started by the lifespan, after the subscriber
        if settings.replicas.enabled:
            self.replicas = ReplicaSync(
                settings.replicas,
                self.placer,
                block_size=settings.block_size,
                process=process,
                clock=clock,
                key=self.peer_key,
            )
            self.placer.listener = self.replicas
            self.prom.register(ReplicaCollector(self.replicas.stats))
        self.tokenizer: Tokenizer = make_tokenizer(
            settings.tokenizer, client=self.upstream, pick=self.pick_tokenize_worker
        )
        self.started_at = time.time()

    # ------------------------------------------------------------------ workers

    async def add_worker(self, cfg: WorkerConfig, *, dynamic: bool = False) -> WorkerState:
        if cfg.id in self.registry:
            raise Conflict(f"worker {cfg.id!r} is already registered")
        if cfg.events_endpoint is None:
            cfg = await self._with_event_sources(cfg)
        # the index learns the worker from the subscriber task, its only writer
        st = self.registry.add(cfg, dynamic=dynamic)
        assert cfg.events_endpoint is not None  # (read from the worker above when not given)
        ep = WorkerEndpoint(
            id=cfg.id,
            events_endpoint=None if cfg.approximate else cfg.events_endpoint,
            replay_endpoint=cfg.replay_endpoint,
            dp_ranks=cfg.dp_ranks,
            model=cfg.model,
        )
        try:
            await self.subscriber.add_worker(ep)
        except Exception as e:
            self.registry.remove(cfg.id)
            raise BadRequest(f"cannot subscribe to worker {cfg.id!r}: {e}") from e
        if cfg.kv_blocks is not None:  # configured: it wins over what /metrics says
            for key in st.keys:
                self.subscriber.set_capacity(key, {"GPU": cfg.kv_blocks})
        return st

    async def _with_event_sources(self, cfg: WorkerConfig) -> WorkerConfig:
        """``cfg`` with the event endpoints the worker publishes on, from its
        ``GET /kv_event_sources`` (vLLM): a configured URL is the only one called."""
        host = urlsplit(cfg.url).hostname or ""
        timeout = self.settings.health.timeout_s
        try:
            sources = await fetch_sources(self.upstream, cfg.base_url, timeout)
            events, replay, dp_ranks = sources_to_endpoints(sources, host)
        except NoEventSource as e:  # it answers, without events: routed on what it was sent
            log.warning(
                "worker %s publishes no KV events (%s): its index entries are what the router "
                "sends it (approximate); events=none says so and skips this check",
                cfg.id,
                e,
            )
            return msgspec.structs.replace(cfg, events_endpoint=EVENTS_NONE)
        except PodNotUsable as e:
            raise BadRequest(
                f"worker {cfg.id!r}: {e}; give events=tcp://HOST:PORT for this worker (its KV "
                "event publisher: vLLM's --kv-events-config endpoint), events=none if it has "
                "none, or start it first"
            ) from e
        log.info("worker %s publishes KV events on %s (replay %s)", cfg.id, events, replay)
        return msgspec.structs.replace(
            cfg, events_endpoint=events, replay_endpoint=replay, dp_ranks=dp_ranks
        )

    async def remove_worker(self, worker_id: str) -> None:
        st = self.registry.workers.get(worker_id)
        if st is None:
            raise NotFound(f"worker {worker_id!r} is not registered")
        self.placer.drop_worker(worker_id, st.keys)
        self.registry.remove(worker_id)
        await self.subscriber.remove_worker(worker_id)  # and, on its task, from the index
        self.metrics.forget_worker(worker_id)

    def _capacity_learned(self, st: WorkerState) -> None:
        """A worker's KV capacity changed (the health checker's scrape): each rank's cap in the
        index follows, set by the subscriber task, the index's only writer (a configured
        ``kv_blocks`` wins)."""
        if st.config.kv_blocks is not None:
            return
        for key, cap in zip(st.keys, st.kv_capacity or ()):
            self.subscriber.set_capacity(key, cap)

    async def check_tokenizer(self) -> None:
        """Warn once per worker whose engine has its own vocabulary while text is tokenized as
        bytes (see ``router.runtime.tokenize.byte_tokenizer_warning``). Runs once, at start."""
        if self.settings.tokenizer != "byte":
            return
        for st in list(self.registry.workers.values()):
            try:
                _, content = await self.upstream.get(
                    st.url, "/v1/models", self.settings.health.timeout_s
                )
            except UpstreamError:
                continue
            msg = byte_tokenizer_warning("byte", st.id, content)
            if msg is not None:
                log.warning("%s", msg)

    def ready(self) -> tuple[bool, list[str]]:
        """Readiness: not draining, and at least one healthy worker whose event stream is live
        (one stuck worker must not take every replica out of its Service); in a fleet with
        roles, one that decodes and, when the fleet has prefill workers and no ``both`` one, a
        prefill one (``Registry.lacking_roles``). Also what it waits for, for the operator: the
        workers whose stream is not live yet, and each role lacking."""
        worker_ready = self.subscriber.worker_ready
        waiting = [w for w in self.registry.workers if not worker_ready(w)]
        if self.draining:
            return False, ["draining"]
        live = any(st.healthy and st.id not in waiting for st in self.registry.workers.values())
        lacking = self.registry.lacking_roles(worker_ready)
        waiting += [f"a routable {role} worker" for role in lacking]
        return live and not lacking, waiting

    def all_ready(self) -> bool:
        """Every configured worker's event stream is connected and replayed."""
        return all(self.subscriber.worker_ready(w) for w in self.registry.workers)

    async def drop_unclaimed(self, grace_s: float = UNCLAIMED_GRACE_S) -> None:
        """After ``grace_s``: drop the restored ranks of workers nobody registered (with worker
        discovery, pods claim theirs as they are found; without it the lifespan drops them at
        once)."""
        await asyncio.sleep(grace_s)
        for wid in sorted({k[0] for k in self.index.workers()} - set(self.registry.workers)):
            log.info("restored index entries of worker %s dropped: no such worker now", wid)
            await self.subscriber.remove_worker(wid)  # (on its task: the index's one writer)

    async def log_time_to_ready(self, t0: float, warm: WarmIndex | None) -> None:
        """Log once every worker's stream is live: how long after ``t0`` (the start), and how
        (warm from a peer's index, :mod:`router.runtime.replicas.warm`, or cold)."""
        while not self.all_ready():
            await asyncio.sleep(0.05)  # a log line: no event exists for readiness
        how = f"warm from {warm.source}" if warm is not None else "cold"
        log.info(
            "ready %.2f s after start (%s), index of %d blocks",
            time.monotonic() - t0,
            how,
            len(self.index),
        )

    def pick_tokenize_worker(self, model: str | None) -> tuple[str, str]:
        for st in self.registry.candidates(model):
            if st.healthy:
                names = st.models()
                return st.url, model or (min(names) if names else "")
        raise NoHealthyWorker("no healthy worker to tokenize with")

    def _samples(self) -> list[WorkerSample]:
        stats = self.subscriber.stats()
        out = []
        for st in self.registry.workers.values():
            since = self.subscriber.seconds_since_last_message(st.id)
            stale = self.registry.events_stale(st, since)
            for key in st.keys:
                try:
                    ix = self.index.worker_stats(key)
                except KeyError:
                    ix = None
                out.append(WorkerSample(key[0], key[1], st.healthy, stats.get(key), ix))
                out[-1].stale = stale
        return out

    async def snapshot_bytes(self) -> bytes:
        """The index and each rank's last applied seq (``PrefixIndex.snapshot_bytes``'s bytes),
        read a rank at a time with the loop free between ranks, encoded in a thread: the loop
        no longer stalls for the whole index (87 ms at 1 M entries), only for the largest
        rank's copy and encode call (18 ms in 8 ranks; ``benchmarks/bench_snapshot.py``)."""
        # only the ranks of workers this replica subscribes to: a restored rank nobody claimed
        # (yet) is not passed on (issue 37, 7: a peer's made-up rank spread to every start)
        sub = self.subscriber
        return await snapshot_off_loop(self.index, sub.resume_point, keep=sub.subscribed)

    async def write_snapshot(self) -> None:
        """:meth:`snapshot_bytes` to ``snapshot.path``, written in a thread (atomic)."""
        path = self.settings.snapshot.path
        if not path:
            return
        data = await self.snapshot_bytes()
        try:
            await asyncio.to_thread(self._save_snapshot, path, data)
        except OSError as e:
            log.warning("index snapshot to %s failed: %s", path, e)

    def _save_snapshot(self, path: str, data: bytes) -> None:
        # a periodic write cancelled at shutdown goes on in its thread: the two take turns
        with self._snapshot_lock:
            PrefixIndex.save_snapshot_bytes(path, data)


async def snapshot_off_loop(
    index: PrefixIndex,
    resume_point: Callable[[WorkerKey], int | None],
    keep: Callable[[WorkerKey], bool] | None = None,
) -> bytes:
    """``index.snapshot_bytes``, a rank at a time (each with the seq ``resume_point`` gives in
    the same step), yielding to the loop between ranks; the encoding runs in a thread.
    ``keep``: which ranks to write (None: all)."""
    builder = index.snapshot_builder()
    for key in builder.ranks():
        if keep is not None and not keep(key):
            continue
        builder.add(key, resume_point(key))
        await asyncio.sleep(0)
    return await asyncio.to_thread(builder.finish())
