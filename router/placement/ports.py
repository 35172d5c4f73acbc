"""What the placement core needs from the world around it, as protocols: the worker table it
reads (:class:`FleetView`), the metrics it reports to (:class:`PlacementMetrics`), a request's
tokens when a front door holds them in another form than a list (:class:`TokenSource`), and who
hears of every committed request's life (:class:`PlacementListener`: replica sync).

The core imports no I/O library; the runtime hands it the real parts (the fleet's
:class:`router.fleet.registry.Registry`, the Prometheus-backed :class:`router.observe.metrics.
RouterMetrics`, the edge's JSON token array), and ``kvrouter replay`` or a benchmark hands it
:data:`NO_METRICS` and a registry of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from router.settings import WorkerConfig
from router.types import ScrapedLoad, WorkerKey

if TYPE_CHECKING:
    from router.placement.load import Ticket

__all__ = [
    "NO_LISTENER",
    "NO_METRICS",
    "FleetView",
    "NoListener",
    "NoMetrics",
    "PlacementListener",
    "PlacementMetrics",
    "TokenSource",
    "WorkerView",
]


class WorkerView(Protocol):
    """One worker as placement reads it (and stamps ``last_routed_at`` on)."""

    healthy: bool
    scraped: ScrapedLoad | None
    keys: list[WorkerKey]  # its ranks
    key_hashes: list[int]  # router.types.worker_hash of each rank
    last_routed_at: float | None

    @property
    def config(self) -> WorkerConfig: ...

    @property
    def id(self) -> str: ...

    @property
    def url(self) -> str: ...


class FleetView(Protocol):
    def candidates(self, model: str | None) -> Sequence[WorkerView]:
        """Workers that may serve ``model``; raises ``router.errors.NotFound`` when none does."""
        ...

    def pools(self) -> list[list[WorkerKey]]:
        """Groups of ranks sharing an EXTERNAL cache pool."""
        ...


class TokenSource(Protocol):
    """A request's token ids held in another form (the edge's JSON text), hashed without
    building the list where it can."""

    count: int  # -1 until known

    def hashes(self, block_size: int, seed: int) -> list[int]: ...

    def tokens(self) -> list[int]: ...


class PlacementMetrics(Protocol):
    """What the core reports; :class:`router.observe.metrics.RouterMetrics` exports it."""

    def decided(self, seconds: float) -> None:
        """One placement computed (hash, match, score) in ``seconds``."""

    def routed(self, worker: str, kind: str, matched_ratio: float | None) -> None:
        """A request placed on ``worker`` (``kind``: proxy, epp, route, route_account);
        ``matched_ratio`` when it was committed there."""

    def flight_started(self, worker: str) -> None:
        """A proxied request is in flight on ``worker``."""

    def first_byte(self, worker: str, seconds: float) -> None: ...

    def proxied(self, worker: str, endpoint: str, status: str) -> None:
        """A proxied request ended (and is no longer in flight)."""

    def account_ended(self, reason: str) -> None:
        """An accounted ``/route`` placement ended: released, expired, evicted, worker_removed."""

    def cached_tokens(self, worker: str, predicted: int, actual: int, leg: str = "") -> None:
        """Cached prompt tokens predicted vs what the worker reported (``leg``: of a remote
        pick, ``prefill`` or ``decode``)."""

    def placement_state(self, predicted_blocks: int, accounted_routes: int) -> None: ...

    def pd_decided(self, decision: str, reason: str) -> None:
        """A disaggregated fleet's pick: ``local`` or ``remote``, and why."""

    def agreement(self, worker: str, reason: str, disagrees: bool) -> None:
        """The closed loop turned ``worker``: its reports disagree with the index (``reason``:
        ``index_ahead`` or ``worker_ahead``), or agree again (``disagrees`` False)."""


class NoMetrics:
    """Metrics that go nowhere: the replay and the benchmarks."""

    def decided(self, seconds: float) -> None:
        pass

    def routed(self, worker: str, kind: str, matched_ratio: float | None) -> None:
        pass

    def flight_started(self, worker: str) -> None:
        pass

    def first_byte(self, worker: str, seconds: float) -> None:
        pass

    def proxied(self, worker: str, endpoint: str, status: str) -> None:
        pass

    def account_ended(self, reason: str) -> None:
        pass

    def cached_tokens(self, worker: str, predicted: int, actual: int, leg: str = "") -> None:
        pass

    def placement_state(self, predicted_blocks: int, accounted_routes: int) -> None:
        pass

    def pd_decided(self, decision: str, reason: str) -> None:
        pass

    def agreement(self, worker: str, reason: str, disagrees: bool) -> None:
        pass


NO_METRICS = NoMetrics()


class PlacementListener(Protocol):
    """Hears each local ticket's life, in order, on the placing loop: replica sync
    (:mod:`router.runtime.replicas`) publishes it to the peer replicas, which apply it as remote
    tickets (:class:`router.placement.remote.RemoteTickets`). It must not block or raise."""

    def committed(self, ticket: Ticket) -> None:
        """A request was committed: its ticket in the load ledger, its blocks predicted."""

    def first_token(self, ticket: Ticket) -> None:
        """Its first answer byte came back: its prefill is over."""

    def ended(self, ticket: Ticket) -> None:
        """It ended (answered, failed, released, expired...)."""


class NoListener:
    """Nobody listens: one router alone, the replay without sync."""

    def committed(self, ticket: Ticket) -> None:
        pass

    def first_token(self, ticket: Ticket) -> None:
        pass

    def ended(self, ticket: Ticket) -> None:
        pass


NO_LISTENER = NoListener()
