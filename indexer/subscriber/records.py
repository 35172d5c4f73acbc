"""The subscriber's records: worker endpoints, exported stats, and the private per-rank state that
only the subscriber task mutates (``WorkerRank``, its sockets' ``Watch`` and its ``Replay``), plus
the subscriber's logger. Data only: the logic lives in the package's other modules."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from indexer.events import EventBatch
from indexer.index.types import WorkerKey

if TYPE_CHECKING:
    from indexer.index import PrefixIndex

__all__ = [
    "UNANCHORED",
    "Replay",
    "SubscriberError",
    "Watch",
    "WorkerEndpoint",
    "WorkerRank",
    "WorkerStats",
    "log",
    "log_limited",
    "rank_endpoint",
]

#: One logger for every part of the subscriber: operators configure "indexer.subscriber".
log = logging.getLogger("indexer.subscriber")

_LOG_EVERY_S = 10.0

#: ``WorkerRank.last`` before anything anchors the stream: the first message is taken as it comes.
UNANCHORED = -2


class SubscriberError(Exception):
    """A worker cannot be registered (bad endpoint, conflicting id) or the subscriber is closed."""


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of dp rank ``rank``: tcp port + rank (as vLLM and SGLang offset their
    publishers), other transports get vLLM's ``_dp<rank>`` suffix for ranks above 0."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or not rest:
        raise SubscriberError(f"invalid ZMQ endpoint {endpoint!r}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or int(port) + rank > 65535:
            raise SubscriberError(f"invalid tcp endpoint {endpoint!r} for dp rank {rank}")
        return f"tcp://{host}:{int(port) + rank}"
    return endpoint if rank == 0 else f"{endpoint}_dp{rank}"


class WorkerEndpoint(msgspec.Struct, frozen=True):
    """Where one worker publishes: the same names as the router's worker config
    (``id``, ``events_endpoint``, ``replay_endpoint``, ``dp_ranks``, ``model``)."""

    id: str
    #: "tcp://host:5557": dp rank r publishes on port + r. None: the worker publishes no
    #: events; its ranks are approximate (``PrefixIndex.record_sent`` feeds them).
    events_endpoint: str | None
    #: The publisher's ROUTER replay endpoint, dp rank r on port + r.
    replay_endpoint: str | None = None
    dp_ranks: int = 1
    model: str = ""


class WorkerStats:
    """Stats of one (worker_id, dp_rank): a plain mutable object the subscriber task updates in
    place; ``Subscriber.stats()`` refreshes ``last_seq``, ``blocks_by_tier`` and ``orphans``."""

    __slots__ = (
        "apply_errors",
        "blocks_by_tier",
        "connected",
        "dp_rank",
        "events_by_type",
        "gaps",
        "lag_s",
        "last_message_at",
        "last_seq",
        "malformed",
        "messages",
        "orphans",
        "replay_done",
        "replay_failures",
        "replayed",
        "replaying",
        "replays",
        "restarts",
        "skipped",
        "trusted",
        "unknown_events",
        "worker_id",
    )

    def __init__(self, worker_id: str, dp_rank: int) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        #: The SUB connection's handshake is done (and no disconnect since).
        self.connected = False
        #: The join-time replay finished (or there is no replay endpoint).
        self.replay_done = False
        self.replaying = False
        #: False while the rank's entries were dropped after lost events (the trust rule in
        #: ``indexer.subscriber.writer``).
        self.trusted = True
        self.last_seq: int | None = None
        #: Batches applied to the index, live or replayed; each seq at most once.
        self.messages = 0
        #: Of ``messages``, those applied from replay replies.
        self.replayed = 0
        #: Live batches received during a replay that the replay had already applied.
        self.skipped = 0
        #: Events applied, by type (from the index's own counters).
        self.events_by_type: dict[str, int] = {}
        self.blocks_by_tier: dict[str, int] = {}
        self.orphans = 0
        self.gaps = 0
        self.replays = 0
        self.replay_failures = 0
        self.restarts = 0
        self.malformed = 0
        self.unknown_events = 0
        #: Batches the index raised on (a bug, counted and skipped).
        self.apply_errors = 0
        #: now − ts of the newest batch received (seconds).
        self.lag_s: float | None = None
        #: Wall time of the last message received (None: never).
        self.last_message_at: float | None = None

    def seconds_since_last_message(self, now: float) -> float | None:
        return None if self.last_message_at is None else max(0.0, now - self.last_message_at)

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["events_by_type"] = dict(self.events_by_type)
        out["blocks_by_tier"] = dict(self.blocks_by_tier)
        return out

    def __repr__(self) -> str:
        return f"WorkerStats({self.as_dict()!r})"


class Watch:
    """One socket registered with the event loop, and what drains it."""

    __slots__ = ("closed", "drain", "fd", "owner", "sock")

    def __init__(
        self, sock: zmq.Socket[bytes], drain: Callable[[WorkerRank], bool], owner: WorkerRank
    ) -> None:
        self.sock = sock
        self.fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self.drain = drain
        self.owner = owner
        self.closed = False


class Replay:
    """One replay request in flight: seqs [start, target) (target None: all the publisher has)."""

    __slots__ = (
        "buffer",
        "deadline",
        "failed",
        "hard_deadline",
        "hi",
        "join",
        "lo",
        "reconcile",
        "sent",
        "start",
        "target",
        "verify",
    )

    def __init__(self, start: int, target: int | None, join: bool, verify: bool = False) -> None:
        self.start = start
        self.target = target
        self.join = join
        #: The request starts at the last applied seq: its first reply must be that batch again
        #: (same ``ts``), or the publisher is a new process (see ``indexer.subscriber.replay``).
        self.verify = verify
        #: Asked from seq 0 to rebuild a snapshot's rank when the publisher holds seq 0
        #: (``indexer.subscriber.restored``).
        self.reconcile = False
        #: Live batches received while replaying, applied after the replay.
        self.buffer: list[EventBatch] = []
        self.sent = False
        self.deadline = 0.0
        self.hard_deadline = 0.0
        #: A hole in the replies already dropped the rank's entries.
        self.failed = False
        #: Seq range of the replies received.
        self.lo: int | None = None
        self.hi: int | None = None


class WorkerRank:
    """The subscriber task's private state for one (worker_id, dp_rank)."""

    __slots__ = (
        "clears",
        "covered",
        "dealer",
        "events_ep",
        "ever_connected",
        "fast",
        "key",
        "last",
        "last_ts",
        "live_last",
        "mon",
        "next_log",
        "rank",
        "replay",
        "replay_ep",
        "stats",
        "sub",
        "trust_after",
        "worker_id",
    )

    def __init__(self, ep: WorkerEndpoint, rank: int) -> None:
        self.worker_id = ep.id
        self.rank = rank
        self.key: WorkerKey = (ep.id, rank)
        if ep.events_endpoint is None:  # (the subscriber opens no rank for such a worker)
            raise SubscriberError(f"worker {ep.id!r} publishes no events: no rank to subscribe")
        self.events_ep = rank_endpoint(ep.events_endpoint, rank)
        self.replay_ep = (
            None if ep.replay_endpoint is None else rank_endpoint(ep.replay_endpoint, rank)
        )
        self.sub: Watch | None = None
        self.mon: Watch | None = None
        self.dealer: Watch | None = None
        #: Last seq applied to the index (UNANCHORED: none yet and any first seq is fine).
        self.last = UNANCHORED
        #: ``ts`` of the batch ``last`` names (None: not known): a publisher that replays another
        #: batch under that seq is a new process.
        self.last_ts: float | None = None
        #: Last seq received on the SUB socket; a live seq at or below it means a restart.
        self.live_last = -1
        self.replay: Replay | None = None
        #: Seqs the last replay applied: their live copies, read after it ended (the SUB had
        #: not been drained yet, or is read once per window), are skipped like buffered ones.
        self.covered: tuple[int, int] | None = None
        self.stats = WorkerStats(ep.id, rank)
        #: Hot-path flag: no replay running and trusted, so seq == last + 1 just applies.
        self.fast = True
        #: Untrusted until an in-order seq above this is applied.
        self.trust_after = -1
        self.ever_connected = False
        self.next_log = 0.0
        #: clear_worker calls made by the subscriber (the index counts them with AllBlocksCleared).
        self.clears = 0

    def refreshed_stats(self, index: PrefixIndex) -> WorkerStats:
        """``stats`` with the seq state and the index's counters of this rank brought up to date."""
        st = self.stats
        st.last_seq = self.last if self.last >= 0 else None
        st.replaying = self.replay is not None
        try:
            ist = index.worker_stats(self.key)
            st.blocks_by_tier = dict(ist.blocks_by_tier)
            st.orphans = ist.orphans
            # The index counts events as it applies them; clears it did for us are not events.
            st.events_by_type = {
                "BlockStored": ist.stored_events,
                "BlockRemoved": ist.removed_events,
                "AllBlocksCleared": max(0, ist.cleared - self.clears),
            }
        except Exception:  # the index owns that record; stats must never fail
            pass
        return st


def log_limited(r: WorkerRank, level: int, msg: str, *args: object) -> None:
    """Log about rank ``r`` at most once per ``_LOG_EVERY_S``: a misbehaving publisher can send
    thousands of bad messages a second."""
    now = time.monotonic()
    if now >= r.next_log:
        r.next_log = now + _LOG_EVERY_S
        log.log(level, "worker %s rank %d: " + msg, r.worker_id, r.rank, *args)
