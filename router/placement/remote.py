"""Remote tickets: the requests that peer router replicas placed (docs/architecture.md §9),
applied to this replica's load ledger and predicted blocks, so that scoring sees a peer's
in-flight load and the prefixes it is computing exactly as it sees its own.

A peer's :class:`router.placement.ports.PlacementListener` side publishes each of its tickets'
life as events — :class:`Placed` (the worker rank, the request's router block hashes, the
prefill blocks it charged, the blocks matched there), :class:`FirstToken`, :class:`Ended` —
and :meth:`RemoteTickets.apply` applies them here, by ``(origin, ticket id)``: ``origin`` names
the peer process (random per start, so a restarted peer never ends its predecessor's tickets).

:func:`placed_event` turns a local ticket into its :class:`Placed` (the glue's and the replay's
one definition), and :class:`EventLog` is a listener that keeps the events for whoever delivers
them (a virtual-time replay: to its other simulated replicas, after a delay of its choice).

A remote ticket ends when its owner's :class:`Ended` arrives, or when its origin goes silent
(``drop_origin``: the glue decides when), or its worker leaves. Its ``Ended`` can only have been
lost where a message from its origin was: the glue sees that as a gap in the origin's sequence
numbers and says so (``gap``), and from then on the tickets that origin had placed before it end
``ttl_s`` after they started (or were last renewed), by ``expire`` from the placer's housekeeping.
A ticket no gap has exposed lives as long as its request, however long it generates. At most
``max_tickets`` live at once: past it the oldest ends (counted). Remote state is budgeted in
bytes too (:data:`HASH_BYTES` a hash, :data:`TICKET_BYTES` a ticket: the worst case measured):
past ``max_origin_bytes`` an origin's own oldest tickets end, past ``max_bytes`` all origins'
oldest (both counted ``over_budget``), so one peer cannot fill the replica's memory, nor all
of them together. Nothing here does I/O or reads a clock of its own, so ``kvrouter replay`` can apply the same events on its simulated clock, with
a delay of its choice.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Annotated, Union

import msgspec

from router.placement.load import LoadLedger, Ticket
from router.placement.predict import PredictedBlocks
from router.types import WorkerKey

__all__ = [
    "HASH_BYTES",
    "TICKET_BYTES",
    "Ended",
    "EventLog",
    "FirstToken",
    "Placed",
    "RemoteEvent",
    "RemoteTickets",
    "placed_event",
    "ticket_bytes",
]

_U63 = msgspec.Meta(ge=0, le=(1 << 63) - 1)


class Placed(msgspec.Struct, array_like=True, tag=1):
    """A peer committed a request on rank ``(worker, rank)``: ``hashes`` are its router block
    hashes (the first ``max_hashes`` of them), ``prefill`` the blocks of prefill it charged,
    ``matched`` the leading blocks the rank held already."""

    ticket: Annotated[int, _U63]
    worker: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    rank: Annotated[int, msgspec.Meta(ge=0, lt=1024)]
    hashes: list[int]
    prefill: Annotated[float, msgspec.Meta(ge=0, le=1e9)]
    matched: Annotated[int, msgspec.Meta(ge=0)]


class FirstToken(msgspec.Struct, array_like=True, tag=2):
    """The peer's request got its first answer byte: its prefill is over."""

    ticket: Annotated[int, _U63]


class Ended(msgspec.Struct, array_like=True, tag=3):
    """The peer's request ended."""

    ticket: Annotated[int, _U63]


RemoteEvent = Union[Placed, FirstToken, Ended]  # noqa: UP007 (a runtime value for msgspec)


def placed_event(ticket: Ticket, max_hashes: int) -> Placed:
    """A local ticket as its peers learn it: its first ``max_hashes`` hashes (a long prompt's
    prefix is what another request can meet), the matched blocks among them."""
    hashes = ticket.hashes
    matched = len(hashes) - len(ticket.prefill_hashes)
    if len(hashes) > max_hashes:
        hashes = hashes[:max_hashes]
        matched = min(matched, max_hashes)
    if type(hashes) is not list:
        hashes = list(hashes)
    k = ticket.key
    return Placed(ticket.id, k[0], k[1], hashes, ticket.prefill, matched)


class EventLog:
    """A :class:`router.placement.ports.PlacementListener` that keeps its tickets' events in
    order until ``take``: replica sync without sockets."""

    def __init__(self, max_hashes: int = 1 << 20) -> None:
        self.max_hashes = max_hashes
        self.events: list[RemoteEvent] = []

    def committed(self, ticket: Ticket) -> None:
        self.events.append(placed_event(ticket, self.max_hashes))

    def first_token(self, ticket: Ticket) -> None:
        self.events.append(FirstToken(ticket.id))

    def ended(self, ticket: Ticket) -> None:
        self.events.append(Ended(ticket.id))

    def take(self) -> list[RemoteEvent]:
        out, self.events = self.events, []
        return out


#: why a remote ticket ended: its owner said so, its TTL, past max_tickets, past a byte budget
#: (its origin's or all origins'), its origin went silent, its worker left
END_REASONS = ("ended", "expired", "evicted", "over_budget", "peer_lost", "worker_removed")
#: why an event was dropped: more hashes than max_hashes or ``matched`` past them, a rank this
#: replica does not know, a ticket id already live, one ticket larger than a byte budget
DROP_REASONS = ("too_many_hashes", "unknown_worker", "duplicate", "too_large")
#: bytes of this replica's memory one remote hash may hold, at worst (every hash distinct, none
#: matched): the ledger's active and prefilling refcounts, the ticket's hash lists, the
#: prediction's entries. Measured with tracemalloc: 244 B (docs/architecture.md §9, "Budgets")
HASH_BYTES = 256
#: and one remote ticket, past its hashes (the ticket, its entries here and in the ledger)
TICKET_BYTES = 512


def ticket_bytes(hashes: int) -> int:
    """What a remote ticket of ``hashes`` hashes counts against the byte budgets."""
    return TICKET_BYTES + HASH_BYTES * hashes


class RemoteTickets:
    """Live remote tickets by ``(origin, ticket id)``: (when its TTL is next looked at, its
    origin's gap count when it started, the ticket), in that first field's order; per origin,
    its tickets' ids in the order they started and the bytes they count."""

    def __init__(
        self,
        ledger: LoadLedger,
        predicted: PredictedBlocks,
        slot_of: Callable[[WorkerKey], int],
        *,
        ttl_s: float,
        max_tickets: int,
        max_hashes: int,
        max_origin_bytes: int = 1 << 62,
        max_bytes: int = 1 << 62,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ledger = ledger
        self._predicted = predicted
        self._slot_of = slot_of  # PrefixIndex.slot: KeyError for a rank it does not know
        self.ttl_s = ttl_s
        self.max_tickets = max_tickets
        self.max_hashes = max_hashes
        self.max_origin_bytes = max_origin_bytes
        self.max_bytes = max_bytes
        self._clock = clock
        self._tickets: OrderedDict[tuple[str, int], tuple[float, int, Ticket]] = OrderedDict()
        #: gaps seen per origin (only origins that had one): a ticket started before its
        #: origin's last gap may have lost its end
        self._gaps: dict[str, int] = {}
        #: per origin: its live tickets' ids, oldest first, and the bytes they count
        self._of: dict[str, dict[int, None]] = {}
        self._origin_bytes: dict[str, int] = {}
        self.bytes = 0
        self.ended = dict.fromkeys(END_REASONS, 0)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)

    def __len__(self) -> int:
        return len(self._tickets)

    def origins(self) -> set[str]:
        return set(self._of)

    def origin_bytes(self, origin: str) -> int:
        """The bytes ``origin``'s live tickets count against its budget."""
        return self._origin_bytes.get(origin, 0)

    def apply(self, origin: str, events: Sequence[RemoteEvent]) -> None:
        """Apply one message's events from peer ``origin``, in order."""
        for ev in events:
            if type(ev) is Placed:
                self._placed(origin, ev)
                continue
            entry = self._tickets.get((origin, ev.ticket))
            if entry is None:  # ended already, evicted, or placed before this replica listened
                continue
            if type(ev) is FirstToken:
                self._ledger.first_token(entry[2])
            else:
                self._end((origin, ev.ticket), "ended")

    def gap(self, origin: str) -> None:
        """Messages from ``origin`` were lost (its sequence numbers skipped): the tickets it
        placed before now may never hear their end, so they become subject to ``ttl_s``."""
        self._gaps[origin] = self._gaps.get(origin, 0) + 1

    def _placed(self, origin: str, ev: Placed) -> None:
        if len(ev.hashes) > self.max_hashes or ev.matched > len(ev.hashes):
            self.dropped["too_many_hashes"] += 1
            return
        key = (ev.worker, ev.rank)
        try:
            slot = self._slot_of(key)
        except KeyError:  # a worker this replica has not (or no longer) subscribed to
            self.dropped["unknown_worker"] += 1
            return
        k = (origin, ev.ticket)
        if k in self._tickets:
            self.dropped["duplicate"] += 1
            return
        cost = ticket_bytes(len(ev.hashes))
        if cost > self.max_origin_bytes or cost > self.max_bytes:
            self.dropped["too_large"] += 1
            return
        now = self._clock()
        self.expire(now)
        tickets = self._tickets
        while len(tickets) >= self.max_tickets:
            self._end(next(iter(tickets)), "evicted")
        mine = self._of.get(origin)
        while mine and self._origin_bytes[origin] + cost > self.max_origin_bytes:
            self._end((origin, next(iter(mine))), "over_budget")  # its own oldest
        while tickets and self.bytes + cost > self.max_bytes:
            self._end(next(iter(tickets)), "over_budget")  # anyone's oldest
        mine = self._of.setdefault(origin, {})  # (ended above with its last ticket, maybe)
        t = self._ledger.start(key, ev.hashes, ev.prefill, ev.matched)
        # the same prediction the owner made on its side (Placer.commit): blocks past the
        # matched prefix, which the worker's events will confirm
        if ev.matched < len(ev.hashes):
            self._predicted.record(ev.hashes[ev.matched :], slot)
        tickets[k] = (now + self.ttl_s, self._gaps.get(origin, 0), t)
        mine[ev.ticket] = None
        self._origin_bytes[origin] = self._origin_bytes.get(origin, 0) + cost
        self.bytes += cost

    def _end(self, k: tuple[str, int], reason: str) -> None:
        """End live ticket ``k``: the one way out, so every count stays true."""
        t = self._tickets.pop(k)[2]
        self._ledger.finish(t)
        self.ended[reason] += 1
        origin = k[0]
        cost = ticket_bytes(len(t.hashes))
        self.bytes -= cost
        left = self._origin_bytes[origin] - cost
        mine = self._of[origin]
        del mine[k[1]]
        if mine:
            self._origin_bytes[origin] = left
        else:
            del self._of[origin], self._origin_bytes[origin]

    def expire(self, now: float | None = None) -> int:
        """End the tickets past their TTL that a gap since their start exposed (their end may
        be lost); renew the others for another TTL. Returns how many ended."""
        tickets = self._tickets
        if not tickets:
            return 0
        if now is None:
            now = self._clock()
        n = 0
        gaps = self._gaps
        while tickets:
            k, (exp, seen, t) = next(iter(tickets.items()))
            if exp > now:
                break
            if gaps.get(k[0], 0) > seen:
                self._end(k, "expired")
                n += 1
            else:
                # nothing lost since it started: its end is still to come. Renewed at the back,
                # the latest TTL, so the order holds.
                del tickets[k]
                tickets[k] = (now + self.ttl_s, seen, t)
        return n

    def drop_origin(self, origin: str) -> int:
        """Peer ``origin`` is gone (silent, restarted under a new origin): end its tickets."""
        gone = list(self._of.get(origin, ()))
        for tid in gone:
            self._end((origin, tid), "peer_lost")
        self._gaps.pop(origin, None)
        return len(gone)

    def drop_worker(self, worker_id: str) -> None:
        """A worker left: its remote tickets end with it."""
        for k in [k for k, (_, _, t) in self._tickets.items() if t.key[0] == worker_id]:
            self._end(k, "worker_removed")
