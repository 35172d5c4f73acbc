"""The placement core: :class:`Placer` places a request (hash → match → score) and commits it
(load ticket, predicted blocks), for every front door alike — ``/route``, the OpenAI proxy and
``kvrouter replay`` call it as it is.

It owns the load ledger, the in-flight count (``admit``), the predicted blocks and the accounted
``/route`` flights, and reads the
prefix index (written only by the subscriber task) and the worker table through
:class:`router.placement.ports.FleetView`. It does no I/O and never awaits, so a decision sees one
consistent index state; its clock, timer and random source are arguments (the event loop's in
service, a simulated one in virtual-time replay).

``place`` = hash the request (per index namespace: the worker's configured model), match it against
the index with the predicted overlay and EXTERNAL pools, fill one
:class:`router.placement.scoring.Candidate` per worker rank with its load and its GPU capacity
(what the index knows the rank's KV holds), and rank them.
``pick`` = the decode worker, and local against remote prefill (:mod:`router.placement.pd`);
``fly`` = commit the request on the chosen rank (account it, record its blocks as predicted there)
and return the :class:`router.placement.flight.Flight` that ends it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence

from indexer.events import CANONICAL_TIERS
from indexer.hashing import request_seed
from indexer.index import PrefixIndex, WorkerMatch
from router.errors import BadRequest, TooManyRequests
from router.placement.agreement import reusable_tokens
from router.placement.awaiting import AwaitingPrefills
from router.placement.config import PlacementSettings
from router.placement.decision import Decision
from router.placement.flight import Admission, Flight, RouteAccounts
from router.placement.load import LoadLedger, Ticket
from router.placement.loop import AgreementLoop
from router.placement.pd import Pick, stall_weight
from router.placement.pd import pick as pd_pick
from router.placement.ports import (
    NO_LISTENER,
    NO_METRICS,
    FleetView,
    PlacementListener,
    PlacementMetrics,
    TokenSource,
    WorkerView,
)
from router.placement.predict import PredictedBlocks
from router.placement.remote import RemoteTickets
from router.placement.scoring import Candidate, rank
from router.types import WorkerKey

__all__ = ["Decision", "Placer"]

_M64 = (1 << 64) - 1
_NO_MATCH = WorkerMatch(0, {})
_NO_SHARED = (0, 0)
_GPU = CANONICAL_TIERS.index("GPU")


def _no_capacity(key: WorkerKey) -> int:
    return 0


class Placer:
    """Places requests on worker ranks; see the module docstring."""

    def __init__(
        self,
        config: PlacementSettings,
        index: PrefixIndex,
        fleet: FleetView,
        *,
        metrics: PlacementMetrics = NO_METRICS,
        listener: PlacementListener = NO_LISTENER,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.fleet = fleet
        self.metrics = metrics
        #: hears every local ticket's life (replica sync publishes it to the peers)
        self.listener = listener
        #: every clock placement reads (prediction TTLs, accounting expiry, last routed)
        self.clock = clock
        #: latencies (decision time, time to first byte)
        self.timer = timer
        self.weights = config.weights
        #: (lane, replicas heard): set by replica sync; lane k > 0 takes the k-th near-best
        #: worker first (router.placement.scoring.rank)
        self.lane = (0, 1)
        self.temperature = config.temperature
        self.rng = rng if rng is not None else random.Random(config.seed)
        self.load = LoadLedger()
        #: requests admitted through a door and not yet ended (``config.max_inflight``)
        self.inflight = 0
        #: prefill workers' engine ids (vLLM's ``remote_engine_id``, new at each start)
        self._engines: dict[str, str] = {}
        #: the flights whose prefill the events end (``fly(by_events=True)``)
        self.awaiting = AwaitingPrefills(index)
        #: writes what the router sent to an approximate rank (no events) into its tree in the
        #: index: the index itself where this loop is its one writer (the replay, a benchmark);
        #: the router hands it to the subscriber task (``Subscriber.record_sent``)
        self.sent: Callable[[WorkerKey, Sequence[int]], object] = index.record_sent
        self.predicted = PredictedBlocks(
            config.predicted_ttl_s, max_blocks=config.predicted_max_blocks, clock=clock
        )
        self.accounts = RouteAccounts(config.account_ttl_s, config.max_accounted, clock)
        #: the closed loop: each answer's reported cached tokens against this prediction
        self.loop = AgreementLoop(config.agreement, index, metrics=metrics, clock=clock)
        #: what the peer replicas placed (their tickets on this ledger and predictions)
        self.remote = RemoteTickets(
            self.load,
            self.predicted,
            index.slot,
            ttl_s=config.ticket_ttl_s,
            max_tickets=config.max_remote_tickets,
            max_hashes=config.max_hashes,
            max_origin_bytes=config.max_peer_state_bytes,
            max_bytes=config.max_remote_state_bytes,
            clock=clock,
        )

    def admit(self) -> Admission:
        """Admit one request through a door, or raise :class:`TooManyRequests` past
        ``max_inflight``; the door releases it once its answer has ended."""
        limit = self.config.max_inflight
        if self.inflight >= limit:
            raise TooManyRequests(f"over max_inflight ({limit} requests in flight)")
        return Admission(self)

    def place(
        self,
        token_ids: Sequence[int] | TokenSource,
        model: str | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
    ) -> Decision:
        """Score every rank that may serve ``model``. Raises :class:`router.errors.NotFound` for
        an unknown model; an empty ``order`` means no healthy worker (the caller answers 503).
        ``max_tokens``: the request's bound on its answer, when it gives one (its stall weight
        where it runs: :func:`router.placement.pd.stall_weight`)."""
        t0 = self.timer()
        states = self.fleet.candidates(model)
        index = self.index
        overlay = self.predicted.overlay()
        pools = self.fleet.pools()
        load = self.load
        load_get = load.get
        capacity = self._capacity if self.weights.overflow_weight > 0 else _no_capacity
        source = None if isinstance(token_ids, Sequence) else token_ids
        candidates: list[Candidate] = []
        cand_hashes: list[Sequence[int]] = []
        cand_states: list[WorkerView] = []
        by_ns: dict[str, tuple[list[int], Mapping[WorkerKey, WorkerMatch]]] = {}
        n = 0
        for st in states:
            ns = st.config.model
            entry = by_ns.get(ns)
            if entry is None:
                try:
                    if source is not None:
                        seed = request_seed(ns, lora_name, cache_salt)
                        hashes = source.hashes(index.block_size, seed)
                    else:
                        assert isinstance(token_ids, Sequence)
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
                    prefill, active, shared, stall = 0.0, 0, _NO_SHARED, 0.0
                else:
                    prefill, active, stall = ld.inflight_prefill, ld.active_blocks, ld.stall
                    shared = load.shared(key, hashes)
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
                        capacity(key),
                        stall,
                    )
                )
                cand_hashes.append(hashes)
                cand_states.append(st)
        if source is not None:
            count = source.count if source.count >= 0 else len(source.tokens())
        else:
            assert isinstance(token_ids, Sequence)
            count = len(token_ids)
        if cand_hashes and cand_hashes[0]:
            request_key = cand_hashes[0][-1]
        else:  # no full block: small, and tuples of ints hash the same in every process
            tokens = source.tokens() if source is not None else token_ids
            request_key = hash(tuple(tokens)) & _M64  # type: ignore[arg-type]
        order = rank(
            candidates,
            n,
            self.weights,
            request_key=request_key,
            temperature=self.temperature,
            rng=self.rng,
            lane=self.lane,
        )
        self.metrics.decided(self.timer() - t0)
        return Decision(
            n, candidates, cand_hashes, order, cand_states, index.block_size, count, max_tokens
        )

    def pick(
        self,
        d: Decision,
        *,
        allow_remote: bool = True,
        eligible: Callable[[WorkerView], bool] | None = None,
    ) -> Pick:
        """The decision's pick (:mod:`router.placement.pd`): the decode worker, and a prefill
        worker when the prompt is better prefilled there. ``allow_remote`` False: one leg on
        the decode worker (``n > 1``, a door that cannot split); ``eligible``: the workers a
        door may send to (Envoy's subset hint). Raises :class:`NoHealthyWorker`."""
        p = pd_pick(
            d,
            pd=self.config.pd,
            weights=self.weights,
            allow_remote=allow_remote,
            eligible=eligible,
        )
        if p.disaggregated:
            self.metrics.pd_decided(p.mode, p.reason)
        return p

    def _capacity(self, key: WorkerKey) -> int:
        """Router blocks rank ``key``'s GPU KV holds, from the capacity the worker reported to the
        index (engine blocks of its page size); 0 when not known."""
        try:
            rec = self.index.worker(key)
        except KeyError:
            return 0
        cap = rec.capacity
        if not cap:
            return 0
        bs = self.index.block_size
        return cap.get(_GPU, 0) * (rec.page or bs) // bs

    def chose(self, d: Decision, i: int, kind: str, *, committed: bool = False) -> None:
        """Count candidate ``i`` as chosen (``kind``: proxy, epp, route, route_account) — the one
        place a placement is counted, whether or not it is committed."""
        c = d.candidates[i]
        d.states[i].last_routed_at = self.clock()
        ratio = c.matched_blocks / d.n if committed and d.n else None
        self.metrics.routed(c.key[0], kind, ratio)

    def commit(self, d: Decision, i: int, *, kind: str, leg: str = "") -> Ticket:
        """Account the request on candidate ``i`` and predict its blocks there. ``leg``
        ``decode``: the decode leg of a remote pick, whose prompt another worker prefills: it
        builds nothing here (its KV arrives by transfer), but holds it all, and the worker
        stores what it pulled (vLLM's decode worker publishes it); ``prefill``: the prefill
        leg, one token, so no stream a prefill there would stall."""
        c = d.candidates[i]
        hashes = d.hashes[i]
        if leg == "prefill":
            weight = 0.0
        else:
            weight = stall_weight(d.max_tokens, self.config.pd.stall_reference_tokens)
        if leg == "decode":
            t = self.load.start(c.key, hashes, 0.0, len(hashes), weight)
        else:
            t = self.load.start(c.key, hashes, d.n - c.credited, c.matched_blocks, weight)
        try:
            slot = self.index.slot(c.key)
        except KeyError:
            slot = -1
        # the blocks past the matched prefix: neither announced by the worker's events nor
        # predicted there already (a prediction keeps its first expiry: one that never comes
        # true ends after ttl_s even while requests for it keep coming)
        if slot >= 0 and c.matched_blocks < len(hashes):
            self.predicted.record(hashes[c.matched_blocks :], slot)
        if slot >= 0 and hashes and self.index.approximate(c.key):
            # no events will say what it stored: the whole prompt enters (or renews) its tree
            self.sent(c.key, hashes)
        self.chose(d, i, kind, committed=True)
        self.listener.committed(t)
        return t

    def fly(
        self,
        d: Decision,
        i: int,
        kind: str,
        *,
        endpoint: str = "",
        t0: float | None = None,
        by_events: bool = False,
        leg: str = "",
    ) -> Flight:
        """Commit candidate ``i`` and return the flight that ends it (``t0``: when the request
        arrived, on ``timer``; now if not given). ``by_events``: the router may see no answer
        byte that marks the prefill's end (an accounted route, the picker seeing only the
        head), so the worker's events end it (:meth:`blocks_stored`). ``leg``: ``prefill`` or
        ``decode`` for a remote pick's two legs (the decode leg builds nothing: ``commit``)."""
        if t0 is None:
            t0 = self.timer()
        c = d.candidates[i]
        ticket = self.commit(d, i, kind=kind, leg=leg)
        predicted_tokens = reusable_tokens(c.matched_blocks, d.tokens, d.block_size)
        f = Flight(
            self.load,
            self.metrics,
            ticket,
            kind,
            matched_blocks=c.matched_blocks,
            predicted_tokens=predicted_tokens,
            endpoint=endpoint,
            t0=t0,
            timer=self.timer,
            listener=self.listener,
            leg=leg,
            by_tier=c.by_tier,
            predicted_blocks=c.predicted_blocks,
            prompt_tokens=d.tokens,
            block_size=d.block_size,
            judge=self.loop.answered,
            stores=self.loop.stores(c.key),
        )
        if by_events:
            self.awaiting.wait(f)
        return f

    def blocks_stored(self, key: WorkerKey) -> None:
        """Rank ``key``'s events were applied: end the prefills they show built
        (:mod:`router.placement.awaiting`; the subscriber calls this after each batch it
        applies, the replay after each step's events)."""
        self.awaiting.blocks_stored(key)

    def engine_seen(self, worker_id: str, engine_id: str, keys: Sequence[WorkerKey]) -> bool:
        """A prefill worker answered with its engine id; True when it changed: the engine
        restarted (a new epoch, its KV gone), so what was predicted on its ranks is dropped
        (its events rebuild what it holds)."""
        old = self._engines.get(worker_id)
        self._engines[worker_id] = engine_id
        if old is None or old == engine_id:
            return False
        for key in keys:
            try:
                self.predicted.drop_slot(self.index.slot(key))
            except KeyError:
                pass
        return True

    def drop_worker(self, worker_id: str, keys: Sequence[WorkerKey]) -> None:
        """A worker left: forget its predictions, end its accounted routes, drop its load."""
        for key in keys:
            try:
                self.predicted.drop_slot(self.index.slot(key))
            except KeyError:
                pass
        self.accounts.drop_worker(worker_id)
        self.remote.drop_worker(worker_id)
        self._engines.pop(worker_id, None)
        self.loop.forget(worker_id)
        self.load.drop_worker(worker_id)
        for key in keys:  # (their flights end as their streams do)
            self.awaiting.drop(key)

    def housekeeping(self) -> None:
        """Periodic: expire accounted routes and predictions, report what is left."""
        self.accounts.expire()
        self.remote.expire()
        self.predicted.expire()
        self.metrics.placement_state(len(self.predicted), len(self.accounts))
