"""The router's state and its placement decision, shared by ``/route`` and the proxy.

:class:`RouterState` is built by the app's lifespan and owns, for one app: the prefix index, the
subscriber (the index's only writer), the HTTP client, the metrics registry, the worker registry,
load accounting, accounted routes and predicted blocks. Everything here runs on the event loop and
never awaits while it reads the index, so a decision sees one consistent index state.

``place`` = hash the request (per index namespace: the worker's configured model), match it against
the index with the predicted overlay and EXTERNAL pools, fill one :class:`router.scoring.Candidate`
per worker rank with its load, and rank them. ``commit`` = account the request on the chosen rank
and record its blocks as predicted there.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

import msgspec
from prometheus_client import CollectorRegistry

from indexer.hashing import request_seed
from indexer.index import IndexError_, PrefixIndex, WorkerKey, WorkerMatch
from indexer.subscriber import Subscriber, WorkerEndpoint
from router.api import JsonTokens
from router.errors import BadRequest, Conflict, NoHealthyWorker, NotFound
from router.flight import RouteAccounts
from router.load import LoadTracker, Ticket
from router.metrics import RouterMetrics, StateCollector, WorkerSample, register_process_metrics
from router.pods import PodNotUsable, fetch_sources, sources_to_endpoints
from router.predict import PredictedBlocks
from router.registry import Registry, WorkerState
from router.scoring import Candidate, ScoreWeights, rank
from router.settings import Settings, WorkerConfig
from router.tokenize import Tokenizer, byte_tokenizer_warning, make_tokenizer
from router.upstream import UpstreamError, UpstreamPool

__all__ = ["Decision", "RouterState"]

log = logging.getLogger("kvrouter.router")
_M64 = (1 << 64) - 1
_NO_MATCH = WorkerMatch(0, {})
_NO_SHARED = (0, 0)


class Decision:
    """One placement: every candidate rank scored, ``order`` = healthy ones best first."""

    __slots__ = ("block_size", "candidates", "hashes", "n", "order", "states", "tokens")

    def __init__(
        self,
        n: int,
        candidates: list[Candidate],
        hashes: list[Sequence[int]],
        order: list[int],
        states: list[WorkerState],
        block_size: int,
        tokens: int,
    ) -> None:
        self.n = n
        self.tokens = tokens  # prompt length
        self.candidates = candidates
        self.hashes = hashes  # per candidate (one list per index namespace, shared)
        self.order = order
        self.states = states  # per candidate
        self.block_size = block_size


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


class RouterState:
    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        #: every clock placement reads (prediction TTLs, accounting expiry, staleness): the
        #: event loop's in service, the simulated one in virtual-time replay
        self.clock = clock
        p = settings.proxy
        self.draining = False  # SIGTERM: /ready answers 503 while in-flight requests finish
        #: the current span's trace headers for the worker, when tracing is on (router.tracing)
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
        self.index, seqs = load_index(settings)
        self.index.set_cap(settings.max_index_entries)
        self.subscriber = Subscriber(
            self.index,
            replay_timeout=settings.subscriber.replay_timeout_s,
            max_message_bytes=settings.subscriber.max_message_bytes,
        )
        if seqs:  # resume each worker rank after its snapshotted seq (replay closes the gap)
            self.subscriber.restore_seqs(seqs)
        sc = settings.scoring
        self.weights = ScoreWeights(
            overlap_weight=sc.overlap_weight,
            tier_weights=sc.effective_tier_weights(),
            running_weight=sc.running_weight,
            waiting_weight=sc.waiting_weight,
            kv_usage_weight=sc.kv_usage_weight,
            cache_credit=sc.cache_credit,
        )
        self.temperature = sc.temperature
        self.rng = random.Random(sc.seed)
        self.registry = Registry(settings.health, scrape_metrics=sc.scrapes_metrics, clock=clock)
        self.load = LoadTracker()
        self.accounts = RouteAccounts(
            settings.route.account_ttl_s, settings.route.max_accounted, clock
        )
        self.predicted = PredictedBlocks(
            sc.predicted_ttl_s, max_blocks=sc.predicted_max_blocks, clock=clock
        )
        self.prom = CollectorRegistry(auto_describe=True)
        self.metrics = RouterMetrics(self.prom)
        self.prom.register(StateCollector(self._samples))
        register_process_metrics(self.prom)
        self.tokenizer: Tokenizer = make_tokenizer(
            settings.tokenizer, client=self.upstream, pick=self.pick_tokenize_worker
        )
        self.inflight = 0
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
            worker_id=cfg.id,
            events=cfg.events_endpoint,
            replay=cfg.replay_endpoint,
            dp_ranks=cfg.dp_ranks,
            model=cfg.model,
        )
        try:
            await self.subscriber.add_worker(ep)
        except Exception as e:
            self.registry.remove(cfg.id)
            raise BadRequest(f"cannot subscribe to worker {cfg.id!r}: {e}") from e
        return st

    async def _with_event_sources(self, cfg: WorkerConfig) -> WorkerConfig:
        """``cfg`` with the event endpoints the worker publishes on, from its
        ``GET /kv_event_sources`` (vLLM): a configured URL is the only one called."""
        host = urlsplit(cfg.url).hostname or ""
        timeout = self.settings.health.timeout_s
        try:
            sources = await fetch_sources(self.upstream, cfg.base_url, timeout)
            events, replay, dp_ranks = sources_to_endpoints(sources, host)
        except PodNotUsable as e:
            raise BadRequest(f"worker {cfg.id!r}: {e}; give events= for this worker") from e
        log.info("worker %s publishes KV events on %s (replay %s)", cfg.id, events, replay)
        return msgspec.structs.replace(
            cfg, events_endpoint=events, replay_endpoint=replay, dp_ranks=dp_ranks
        )

    async def remove_worker(self, worker_id: str) -> None:
        st = self.registry.workers.get(worker_id)
        if st is None:
            raise NotFound(f"worker {worker_id!r} is not registered")
        for key in st.keys:
            try:
                self.predicted.drop_slot(self.index.slot(key))
            except KeyError:
                pass
        self.registry.remove(worker_id)
        await self.subscriber.remove_worker(worker_id)  # and, on its task, from the index
        self.accounts.drop_worker(worker_id)
        self.load.drop_worker(worker_id)
        self.metrics.forget_worker(worker_id)

    async def check_tokenizer(self) -> None:
        """Warn once per worker whose engine has its own vocabulary while text is tokenized as
        bytes (see ``router.tokenize.byte_tokenizer_warning``). Runs once, at start."""
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
        (one stuck worker must not take every replica out of its Service); also the workers
        still waiting for their stream, for the operator."""
        waiting = [w for w in self.registry.workers if not self.subscriber.worker_ready(w)]
        if self.draining:
            return False, ["draining"]
        live = any(st.healthy and st.id not in waiting for st in self.registry.workers.values())
        return live, waiting

    def all_ready(self) -> bool:
        """Every configured worker's event stream is connected and replayed."""
        return all(self.subscriber.worker_ready(w) for w in self.registry.workers)

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

    # ---------------------------------------------------------------- placement

    def place(
        self,
        token_ids: Sequence[int] | JsonTokens,
        model: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Decision:
        """Score every rank that may serve ``model``. Raises :class:`NotFound` for an unknown
        model; an empty ``order`` means no healthy worker (the caller answers 503)."""
        t0 = time.perf_counter()
        states = self.registry.candidates(model)
        index = self.index
        overlay = self.predicted.overlay()
        pools = self.registry.pools()
        load_get = self.load.get
        candidates: list[Candidate] = []
        cand_hashes: list[Sequence[int]] = []
        cand_states: list[WorkerState] = []
        by_ns: dict[str, tuple[list[int], Mapping[WorkerKey, WorkerMatch]]] = {}
        n = 0
        for st in states:
            ns = st.config.model
            entry = by_ns.get(ns)
            if entry is None:
                try:
                    if isinstance(token_ids, JsonTokens):
                        seed = request_seed(ns, lora_name, cache_salt)
                        hashes = token_ids.hashes(index.block_size, seed)
                    else:
                        hashes = index.request_hashes(
                            token_ids, model=ns, lora_name=lora_name, cache_salt=cache_salt
                        )
                except (TypeError, OverflowError, ValueError) as e:
                    raise BadRequest(f"token_ids: {e}") from e
                # a request that meets no prediction keeps the index's fast path
                ov = overlay if overlay is not None and self.predicted.might_meet(hashes) else None
                res = index.match(hashes, overlay=ov, pools=pools)
                entry = by_ns[ns] = (hashes, res.workers)
                n = res.request_blocks
            hashes, matches = entry
            for key, wh in zip(st.keys, st.key_hashes):
                wm = matches.get(key, _NO_MATCH)
                ld = load_get(key)
                if ld is None:
                    prefill, active, shared = 0.0, 0, _NO_SHARED
                else:
                    prefill, active = ld.inflight_prefill, ld.active_blocks
                    shared = self.load.shared(key, hashes)
                candidates.append(
                    Candidate(
                        key,
                        st.healthy,
                        wm.matched_blocks,
                        wm.by_tier,
                        wm.predicted_blocks,
                        prefill,
                        active,
                        shared[0],
                        shared[1],
                        st.scraped,
                        wh,
                    )
                )
                cand_hashes.append(hashes)
                cand_states.append(st)
        if isinstance(token_ids, JsonTokens):
            count = token_ids.count if token_ids.count >= 0 else len(token_ids.tokens())
        else:
            count = len(token_ids)
        if cand_hashes and cand_hashes[0]:
            request_key = cand_hashes[0][-1]
        else:  # no full block: small, and tuples of ints hash the same in every process
            tokens = token_ids.tokens() if isinstance(token_ids, JsonTokens) else token_ids
            request_key = hash(tuple(tokens)) & _M64
        order = rank(
            candidates,
            n,
            self.weights,
            request_key=request_key,
            temperature=self.temperature,
            rng=self.rng,
        )
        self.metrics.decision_latency.observe(time.perf_counter() - t0)
        return Decision(
            n, candidates, cand_hashes, order, cand_states, self.index.block_size, count
        )

    def commit(self, d: Decision, i: int, *, kind: str) -> Ticket:
        """Account the request on candidate ``i`` and predict its blocks there."""
        c = d.candidates[i]
        hashes = d.hashes[i]
        t = self.load.start(c.key, hashes, d.n - c.credited, c.matched_blocks)
        try:
            slot = self.index.slot(c.key)
        except KeyError:
            slot = -1
        # the blocks past the matched prefix: neither announced by the worker's events nor
        # predicted there already (a prediction keeps its first expiry: one that never comes
        # true ends after ttl_s even while requests for it keep coming)
        if slot >= 0 and c.matched_blocks < len(hashes):
            self.predicted.record(hashes[c.matched_blocks :], slot)
        m = self.metrics
        m.child(m.route_decisions, c.key[0], kind).inc()
        d.states[i].last_routed_at = self.clock()
        if d.n:
            self.metrics.matched_ratio.observe(c.matched_blocks / d.n)
        return t

    def write_snapshot(self) -> None:
        """Index + last applied seq per rank to ``snapshot.path`` (atomic), on the event loop
        like every index read."""
        path = self.settings.snapshot.path
        if not path:
            return
        try:
            self.index.snapshot(path, self.subscriber.resume_points())
        except OSError as e:
            log.warning("index snapshot to %s failed: %s", path, e)

    def housekeeping(self) -> None:
        """Periodic: expire accounted routes and predictions, refresh gauges."""
        self.accounts.expire()
        self.predicted.expire()
        self.metrics.predicted_blocks.set(len(self.predicted))
        self.metrics.accounted_routes.set(len(self.accounts))
