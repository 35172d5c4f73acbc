"""The pure placement core (docs/architecture.md §5): hash → match → score → commit, and a placed
request's life. No I/O library is imported here (``import-linter`` holds it), so ``/route``, the
proxy, ``kvrouter replay`` and the benchmarks all call one :class:`Placer` as it is.

- ``placer``: :class:`Placer` and its :class:`Decision`;
- ``flight``: :class:`Flight` (commit → first byte → finish), :class:`RouteAccounts`;
- ``load``: the load ledger and its tickets; ``predict``: predicted blocks against herding;
- ``scoring``: the cost formula, pure functions;
- ``remote``: what peer replicas placed, applied as remote tickets (replica sync);
- ``ports``: what the core reads and reports to, as protocols.
"""

from router.placement.flight import Flight, RouteAccounts, cached_tokens_of
from router.placement.load import LoadLedger, Ticket, TicketState
from router.placement.placer import Decision, Placer
from router.placement.ports import (
    NO_LISTENER,
    NO_METRICS,
    FleetView,
    PlacementListener,
    PlacementMetrics,
    TokenSource,
    WorkerView,
)
from router.placement.remote import (
    Ended,
    EventLog,
    FirstToken,
    Placed,
    RemoteEvent,
    RemoteTickets,
    placed_event,
)

__all__ = [
    "NO_LISTENER",
    "NO_METRICS",
    "Decision",
    "Ended",
    "EventLog",
    "FirstToken",
    "FleetView",
    "Flight",
    "LoadLedger",
    "Placed",
    "PlacementListener",
    "PlacementMetrics",
    "Placer",
    "RemoteEvent",
    "RemoteTickets",
    "RouteAccounts",
    "Ticket",
    "TicketState",
    "TokenSource",
    "WorkerView",
    "cached_tokens_of",
    "placed_event",
]
