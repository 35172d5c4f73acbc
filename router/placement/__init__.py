"""The pure placement core (docs/architecture.md §5): hash → match → score → commit, and a placed
request's life. No I/O library is imported here (``import-linter`` holds it), so ``/route``, the
proxy, ``kvrouter replay`` and the benchmarks all call one :class:`Placer` as it is.

- ``config``: :class:`PlacementSettings`, the settings the core reads;
- ``placer``: :class:`Placer` and its :class:`Decision`; ``pd``: the :class:`Pick` (decode
  worker, and a prefill worker when the prompt is prefilled elsewhere);
- ``flight``: :class:`Flight` (commit → first byte → finish), :class:`Admission` (the in-flight
  count), :class:`RouteAccounts`;
- ``load``: the load ledger and its tickets; ``predict``: predicted blocks against herding;
- ``scoring``: the cost formula, pure functions;
- ``agreement``: does a worker's reported cache agree with the index (``kvrouter check``, the
  closed loop);
- ``remote``: what peer replicas placed, applied as remote tickets (replica sync);
- ``ports``: what the core reads and reports to, as protocols.
"""

from router.placement.agreement import AgreementEstimator, Comparison, Observation, Verdict, compare
from router.placement.config import PlacementSettings
from router.placement.flight import Admission, Flight, RouteAccounts
from router.placement.load import LoadLedger, Ticket, TicketState
from router.placement.pd import AGGREGATED, LOCAL, REMOTE, Choice, Pick, cached_tokens
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
    "AGGREGATED",
    "LOCAL",
    "NO_LISTENER",
    "NO_METRICS",
    "REMOTE",
    "Admission",
    "AgreementEstimator",
    "Choice",
    "Comparison",
    "Decision",
    "Ended",
    "EventLog",
    "FirstToken",
    "FleetView",
    "Flight",
    "LoadLedger",
    "Observation",
    "Pick",
    "Placed",
    "PlacementListener",
    "PlacementMetrics",
    "PlacementSettings",
    "Placer",
    "RemoteEvent",
    "RemoteTickets",
    "RouteAccounts",
    "Ticket",
    "TicketState",
    "TokenSource",
    "Verdict",
    "WorkerView",
    "cached_tokens",
    "compare",
    "placed_event",
]
