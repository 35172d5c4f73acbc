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
from collections.abc import Callable

import msgspec

from router.placement.load import LoadLedger, Ticket, TicketState
from router.placement.ports import NO_LISTENER, PlacementListener, PlacementMetrics

__all__ = ["PROXIED_KINDS", "Flight", "RouteAccounts", "cached_tokens_of"]

#: flight kinds whose answer passes the router (in-flight, TTFB and proxied-by-status metrics)
PROXIED_KINDS = frozenset({"proxy", "epp"})


class _Usage(msgspec.Struct):
    class _Details(msgspec.Struct):
        cached_tokens: int | None = None

    prompt_tokens_details: _Details | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_decode_usage = msgspec.json.Decoder(_WithUsage).decode


def cached_tokens_of(payload: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI answer (or SSE chunk), if any."""
    try:
        u = _decode_usage(payload).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if u is None or u.prompt_tokens_details is None:
        return None
    return u.prompt_tokens_details.cached_tokens


class Flight:
    """One request committed to one worker rank, from commit to ``done``. Made by
    :meth:`router.placement.placer.Placer.fly`; ``t0`` and ``timer`` time the first byte."""

    __slots__ = (
        "awaiting",
        "cached",
        "endpoint",
        "kind",
        "ledger",
        "listener",
        "matched_blocks",
        "metrics",
        "predicted_tokens",
        "t0",
        "ticket",
        "timer",
        "ttfb_seen",
        "usage_tail",
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
    ) -> None:
        self.ledger = ledger
        self.listener = listener
        self.metrics = metrics
        self.ticket = ticket
        self.worker = ticket.key[0]
        self.kind = kind
        self.endpoint = endpoint
        self.matched_blocks = matched_blocks
        self.predicted_tokens = predicted_tokens
        self.t0 = t0
        self.timer = timer
        self.usage_tail = b""
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

    def scan(self, chunk: bytes) -> None:
        """Find the usage chunk of an SSE stream (lines may straddle network chunks)."""
        if not self.usage_tail and b"cached_tokens" not in chunk:
            if b"\n" not in chunk[-1:]:
                self.usage_tail = chunk[chunk.rfind(b"\n") + 1 :][-4096:]
            return
        buf = self.usage_tail + chunk
        lines = buf.split(b"\n")
        self.usage_tail = lines.pop()[-65536:]
        for line in lines:
            if line.startswith(b"data:") and b"cached_tokens" in line:
                v = cached_tokens_of(line[5:].strip())
                if v is not None:
                    self.cached = v

    def _stop_awaiting(self) -> None:
        if self.awaiting is not None:
            self.awaiting.pop(self.ticket.id, None)
            self.awaiting = None

    def done(self, status: str) -> None:
        """The end: an HTTP status or ``client_disconnect`` / ``upstream_error`` for the proxy
        (``client_disconnect`` / ``protocol_error`` for the EPP's stream),
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
            m.cached_tokens(self.worker, self.predicted_tokens, self.cached)


class RouteAccounts:
    """``/route`` calls with ``account: true``: ``route_id`` → flight, until it ends."""

    def __init__(
        self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._routes: OrderedDict[str, tuple[float, Flight]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._routes)

    def add(self, f: Flight) -> str:
        self.expire()
        while len(self._routes) >= self.max_entries:
            _, (_, old) = self._routes.popitem(last=False)
            old.done("evicted")
        rid = secrets.token_hex(12)
        self._routes[rid] = (self._clock() + self.ttl_s, f)
        return rid

    def release(self, route_id: str) -> bool:
        entry = self._routes.pop(route_id, None)
        if entry is None:
            return False
        entry[1].done("released")
        return True

    def expire(self) -> None:
        now = self._clock()
        routes = self._routes
        while routes:
            rid, (exp, f) = next(iter(routes.items()))
            if exp > now:
                break
            del routes[rid]
            f.done("expired")

    def drop_worker(self, worker_id: str) -> None:
        for rid in [r for r, (_, f) in self._routes.items() if f.worker == worker_id]:
            self._routes.pop(rid)[1].done("worker_removed")
