"""One placed request's life on the router: :class:`Flight` owns commit → first byte → finish
for every request the router accounts — the load ticket, the in-flight / TTFB / proxied metrics,
and the predicted-vs-actual cached tokens. :meth:`router.placement.placer.Placer.fly` commits a
placement and hands back its flight. Its users:

- the OpenAI proxy (``kind="proxy"``): one flight per attempt on a worker; ``first_byte`` at the
  first upstream body byte, ``done(status)`` when the answer ends, fails or the client leaves;
- the Envoy endpoint picker (``kind="epp"``): Envoy forwards the request to the worker picked for
  it and streams the answer through the picker, so its flight is a proxied one too (the same
  in-flight, TTFB and proxied metrics), ended with the answer or the ext_proc stream; with the
  answer's body kept off the picker it sees only the head (``head``);
- ``/route`` with ``account: true`` (``kind="route_account"``): the caller forwards the request
  itself, so the flight waits in :class:`RouteAccounts` until ``POST /route/{id}/release``, its
  TTL, eviction by a newer one past ``route.max_accounted``, or its worker's removal;
- ``kvrouter replay``'s kvrouter policy, on its simulated clock.

A flight closes exactly once: a second ``done`` does nothing, so no ticket is finished twice and
no metric counts one request twice. Nothing else touches a load ticket.

The prefill is over at the first answer byte. Where the router may see none (an accounted
``/route``, the picker seeing only the head, which vLLM sends before the prefill has even
begun), the flight is made ``by_events``: the worker's KV events showing the request's blocks
stored end it (:meth:`router.placement.placer.Placer.blocks_stored`).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Protocol

from router.placement.load import LoadLedger, Ticket, TicketState
from router.placement.ports import NO_LISTENER, PlacementListener, PlacementMetrics

__all__ = ["PROXIED_KINDS", "Admission", "Flight", "RouteAccounts"]

#: flight kinds whose answer passes the router (in-flight, TTFB and proxied-by-status metrics)
PROXIED_KINDS = frozenset({"proxy", "epp"})


class Flight:
    """One request committed to one worker rank, from commit to ``done``. Made by
    :meth:`router.placement.placer.Placer.fly`; ``t0`` and ``timer`` time the first byte."""

    __slots__ = (
        "awaiting",
        "block_size",
        "by_tier",
        "cached",
        "endpoint",
        "judge",
        "kind",
        "ledger",
        "leg",
        "listener",
        "matched_blocks",
        "metrics",
        "predicted_blocks",
        "predicted_tokens",
        "prompt_tokens",
        "stores",
        "t0",
        "ticket",
        "timer",
        "ttfb_seen",
        "worker",
    )

    def __init__(
        self,
        ledger: LoadLedger,
        metrics: PlacementMetrics,
        ticket: Ticket,
        kind: str,
        *,
        matched_blocks: int,
        predicted_tokens: int,
        endpoint: str = "",
        t0: float,
        timer: Callable[[], float] = time.perf_counter,
        listener: PlacementListener = NO_LISTENER,
        leg: str = "",
        by_tier: Mapping[str, int] | None = None,
        predicted_blocks: int = 0,
        prompt_tokens: int = 0,
        block_size: int = 0,
        judge: Callable[[Flight], None] | None = None,
        stores: int = -1,
    ) -> None:
        self.ledger = ledger
        #: ``prefill`` / ``decode``: a leg of a disaggregated request; "" for a whole one
        self.leg = leg
        self.listener = listener
        self.metrics = metrics
        self.ticket = ticket
        self.worker = ticket.key[0]
        self.kind = kind
        self.endpoint = endpoint
        self.matched_blocks = matched_blocks
        self.predicted_tokens = predicted_tokens
        # what the placement predicted, for the closed loop (``router.placement.loop``): the
        # prompt's blocks the index held there per tier, those only predicted, its length
        self.by_tier: Mapping[str, int] = by_tier if by_tier is not None else {}
        self.predicted_blocks = predicted_blocks
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size
        #: hears the ended flight whose answer reported cached tokens (``AgreementLoop``)
        self.judge = judge
        #: the stores the rank's events had made when it was placed (-1: not known), which
        #: tells the loop whether its events said anything since (``AgreementLoop.stores``)
        self.stores = stores
        self.t0 = t0
        self.timer = timer
        #: the cached prompt tokens the worker's answer reported (the edge reads its usage)
        self.cached: int | None = None
        self.ttfb_seen = False
        #: the placer's flights awaiting their prefill's events on this rank, this one among
        #: them (``Placer.fly``); it leaves when its prefill is over
        self.awaiting: dict[int, Flight] | None = None
        if kind in PROXIED_KINDS:
            metrics.flight_started(self.worker)

    def first_byte(self) -> None:
        """The worker's first answer byte: the request's prefill is over (idempotent: the proxy
        calls it for every chunk, so a repeat costs one test)."""
        if self.ttfb_seen and self.ticket.state is not TicketState.PREFILL:
            return  # (a flight still awaiting events is in PREFILL)
        self._time_head()
        self.prefill_over()

    def head(self) -> None:
        """The answer's head, timed as the first byte (TTFB), when no body byte will be seen.
        It says nothing of a prefill that has blocks to build (vLLM sends it at once): that one
        ends with the events showing them stored, or with the flight. One with none to build,
        or not waiting for events, ends here (idempotent)."""
        self._time_head()
        if self.awaiting is None:
            self.prefill_over()

    def _time_head(self) -> None:
        if not self.ttfb_seen and self.ticket.state is not TicketState.DONE:
            self.ttfb_seen = True
            self.metrics.first_byte(self.worker, self.timer() - self.t0)

    def prefill_over(self) -> None:
        """The request's prefill is over: its blocks count as decoding from now (idempotent)."""
        self._stop_awaiting()
        if self.ticket.state is TicketState.PREFILL:
            self.ledger.first_token(self.ticket)
            self.listener.first_token(self.ticket)

    def _stop_awaiting(self) -> None:
        if self.awaiting is not None:
            self.awaiting.pop(self.ticket.id, None)
            self.awaiting = None

    def done(self, status: str) -> None:
        """The end: an HTTP status or ``client_disconnect`` / ``upstream_error`` for the proxy
        (and ``prefill_failed`` / ``prefill_refused`` for a decode leg whose prefill leg failed
        or got a 4xx before it was sent; ``client_disconnect`` / ``protocol_error`` for the
        EPP's stream),
        ``released`` / ``expired`` / ``evicted`` / ``worker_removed`` for an accounted route."""
        if self.ticket.state is TicketState.DONE:
            return
        self._stop_awaiting()
        self.ledger.finish(self.ticket)
        self.listener.ended(self.ticket)
        m = self.metrics
        if self.kind in PROXIED_KINDS:
            m.proxied(self.worker, self.endpoint, status)
        else:
            m.account_ended(status)
        if self.cached is not None:
            m.cached_tokens(self.worker, self.predicted_tokens, self.cached, self.leg)
            if self.judge is not None:
                self.judge(self)


class Admission:
    """One request admitted through a door (:meth:`router.placement.placer.Placer.admit`): it
    counts in the placer's ``inflight`` until released, once."""

    __slots__ = ("_placer",)

    def __init__(self, placer: _Counted) -> None:
        placer.inflight += 1
        self._placer: _Counted | None = placer

    def release(self) -> None:
        p, self._placer = self._placer, None
        if p is not None:
            p.inflight -= 1


class _Counted(Protocol):
    inflight: int


class RouteAccounts:
    """``/route`` calls with ``account: true``: ``route_id`` → its flights (one, or a
    disaggregated pick's two legs), until they end."""

    def __init__(
        self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._routes: OrderedDict[str, tuple[float, tuple[Flight, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._routes)

    def add(self, *flights: Flight) -> str:
        self.expire()
        while len(self._routes) >= self.max_entries:
            _, (_, old) = self._routes.popitem(last=False)
            _end(old, "evicted")
        rid = secrets.token_hex(12)
        self._routes[rid] = (self._clock() + self.ttl_s, flights)
        return rid

    def release(self, route_id: str) -> bool:
        entry = self._routes.pop(route_id, None)
        if entry is None:
            return False
        _end(entry[1], "released")
        return True

    def expire(self) -> None:
        now = self._clock()
        routes = self._routes
        while routes:
            rid, (exp, fs) = next(iter(routes.items()))
            if exp > now:
                break
            del routes[rid]
            _end(fs, "expired")

    def drop_worker(self, worker_id: str) -> None:
        gone = [r for r, (_, fs) in self._routes.items() if any(f.worker == worker_id for f in fs)]
        for rid in gone:
            _end(self._routes.pop(rid)[1], "worker_removed")


def _end(flights: tuple[Flight, ...], status: str) -> None:
    for f in flights:
        f.done(status)
