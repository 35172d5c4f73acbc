"""The ``Subscriber``: the event plane's edge and the prefix index's only writer.

For every worker and dp rank it subscribes to the worker's event endpoint (rank r on base port +
r) and, while a replay runs, talks to its replay endpoint (also base port + r). One asyncio task
does all of it and is the only code that mutates the index; ``add_worker``/``remove_worker``/
``restore_seqs``/``set_capacity``/``record_sent`` are commands to it. A worker without events
gets no sockets: its ranks are approximate, fed by ``record_sent`` (what the router sent
there). The subscriber holds the registry of workers and the task, and one of each part it
composes:

- ``sockets.Sockets``: the sockets, their registration with the loop, the task's wait;
- ``stream.StreamRules``: what to do with each live batch and connection event;
- ``replay.Replays``: replays, and telling a new publisher process;
- ``writer.IndexWriter``: the writes to the index both of those make;
- ``restored.RestoredRanks``: a snapshot's ranks, and how far they are trusted.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from indexer.events import EventBatch, ResumePoint
from indexer.index.types import WorkerKey
from indexer.subscriber.records import (
    UNANCHORED,
    SubscriberError,
    WorkerEndpoint,
    WorkerRank,
    WorkerStats,
    log,
    rank_endpoint,
)
from indexer.subscriber.replay import Replays
from indexer.subscriber.restored import RestoredRanks
from indexer.subscriber.sockets import Sockets
from indexer.subscriber.stream import StreamRules
from indexer.subscriber.writer import IndexWriter

if TYPE_CHECKING:
    from indexer.index import PrefixIndex

__all__ = ["Subscriber"]


class Subscriber:
    """Subscribes to every worker's KV event stream and applies it to ``index``."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        context: zmq.Context[Any] | None = None,
        replay_timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
        # a rank's receive queue, in messages: past it libzmq stops reading the socket (TCP
        # pushes back), so a publisher faster than the router buffers in its own memory
        rcvhwm: int = 1_000,
        max_buffered: int = 100_000,
        max_message_bytes: int = 64 << 20,
        # seconds: a busy fleet's messages are read once per window, not each on a wake-up of
        # its own (``indexer.subscriber.sockets``); 0 reads every message as it comes
        batch_window: float = 0.0,
        # called with a rank's key after each batch applied to it (live or replayed), on this
        # task: what was stored there is now in the index (the router ends prefills with it)
        on_applied: Callable[[WorkerKey], None] | None = None,
    ) -> None:
        self._index = index
        self._own_ctx = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        self._clock = clock
        self._sockets = Sockets(
            self._ctx,
            rcvhwm=rcvhwm,
            max_message_bytes=max_message_bytes,
            batch_window=batch_window,
        )
        writer = IndexWriter(index, on_applied)
        self._replays = Replays(
            writer, self._sockets, clock=clock, timeout=replay_timeout, then=self._after_replay
        )
        self._stream = StreamRules(
            index, writer, self._replays, self._sockets, clock=clock, max_buffered=max_buffered
        )
        self._workers: dict[str, tuple[WorkerEndpoint, list[WorkerRank]]] = {}
        self._restored = RestoredRanks(index, writer, self._replays)
        self._commands: deque[tuple[str, Any, asyncio.Future[None] | None]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False

    # ----------------------------------------------------------------- public API

    async def start(self) -> None:
        if self._closed:
            raise SubscriberError("subscriber is closed")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-subscriber")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closing = True
        self._sockets.wakeup()
        if self._task is not None:
            await self._task
        self._closed = True
        self._sockets.release()  # no poll timer outlives the subscriber
        for _, ranks in self._workers.values():
            for r in ranks:
                self._close_rank(r)
        self._workers.clear()
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    async def add_worker(self, ep: WorkerEndpoint) -> None:
        """Subscribe to ``ep`` (every dp rank). Returns once its sockets are connecting."""
        if not ep.id or ep.dp_ranks < 1:
            raise SubscriberError(f"invalid worker endpoint {ep!r}")
        for rank in range(ep.dp_ranks):
            if ep.events_endpoint is not None:
                rank_endpoint(ep.events_endpoint, rank)
            if ep.replay_endpoint is not None:
                rank_endpoint(ep.replay_endpoint, rank)
        await self._submit("add", ep)

    async def remove_worker(self, worker_id: str) -> None:
        """Unsubscribe ``worker_id`` and drop its index entries (every dp rank)."""
        await self._submit("remove", worker_id)

    def restore_seqs(self, seqs: Mapping[WorkerKey, int]) -> None:
        """After ``PrefixIndex.restore``: resume each rank (added now or later) at its snapshotted
        seq, checked to come from the same publisher process (else its entries are rebuilt); a
        gap the publisher can no longer replay drops that rank's entries."""
        self._post("restore", dict(seqs))

    def set_capacity(self, key: WorkerKey, capacity: Mapping[str, int] | None) -> None:
        """Rank ``key``'s KV capacity in engine blocks per tier (None: not known), which caps
        its entries in the index (``PrefixIndex.set_rank_capacity``): a command to the task."""
        self._post("capacity", (key, None if capacity is None else dict(capacity)))

    def record_sent(self, key: WorkerKey, hashes: Sequence[int]) -> None:
        """The router sent a request of router blocks ``hashes`` to rank ``key``: on an
        approximate rank they enter its tree (``PrefixIndex.record_sent``), a command to the
        task, the index's only writer (a rank fed by events ignores it)."""
        self._post("sent", (key, hashes))

    def set_source(self, key: WorkerKey, approximate: bool, keep: bool = False) -> None:
        """The closed loop's switch (``router.placement.loop``), a command to the task: score rank
        ``key`` from its approximate tree alone (``approximate``: its events disagree with what
        the worker reports, and are not applied meanwhile), or go back to its events from a
        fresh stream: a replay of all its publisher still holds, else its entries rebuilt from
        the live events on. Either way the other kind's entries are dropped
        (``PrefixIndex.set_approximate``), except with ``keep``: the blocks its events hold seed
        its tree (they were true, only incomplete); a worker without events stays approximate."""
        self._post("source", (key, approximate, keep))

    def stats(self) -> dict[WorkerKey, WorkerStats]:
        """Per (worker_id, dp_rank) stats, refreshed from the index (the objects are live)."""
        return {r.key: r.refreshed_stats(self._index) for r in self._ranks()}

    def subscribed(self, key: WorkerKey) -> bool:
        """Whether rank ``key`` is one of an added worker's (a snapshot's rank no worker has
        claimed is not: it is never exported again)."""
        entry = self._workers.get(key[0])
        # (an approximate rank is the router's own guess: nothing a warm start could check)
        ep = entry[0] if entry is not None else None
        return ep is not None and ep.events_endpoint is not None and key[1] < ep.dp_ranks

    def snapshot_drops(self) -> dict[str, int]:
        """A snapshot's ranks dropped, cleared or rebuilt, by reason
        (:mod:`indexer.subscriber.restored`)."""
        return self._restored.counts()

    def resume_points(self) -> dict[WorkerKey, ResumePoint]:
        """Per worker rank: the last applied seq and its batch's ts, what a snapshot records."""
        return {r.key: p for r in self._ranks() if (p := _resume_point(r)) is not None}

    def resume_point(self, key: WorkerKey) -> ResumePoint | None:
        """One worker rank's entry of ``resume_points``: read in the same step as its index
        tables, they agree (this task applies a batch and advances the seq in one step)."""
        entry = self._workers.get(key[0])
        rank = next((r for r in entry[1] if r.key == key), None) if entry is not None else None
        return None if rank is None else _resume_point(rank)

    def workers(self) -> dict[str, WorkerEndpoint]:
        return {wid: ep for wid, (ep, _) in self._workers.items()}

    def worker_ready(self, worker_id: str) -> bool:
        """Every rank connected and its join-time replay done (or it has no replay endpoint)."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return False
        return all(r.stats.connected and r.stats.replay_done for r in entry[1])

    def ready(self) -> bool:
        return all(self.worker_ready(wid) for wid in self._workers)

    @property
    def batching(self) -> bool:
        """The event sockets are read once per ``batch_window`` (the fleet is busy), not on a
        wake-up per message."""
        return self._sockets.held

    def seconds_since_last_message(self, worker_id: str) -> float | None:
        """Freshness: seconds since any rank of the worker last sent a message (None: never)."""
        entry = self._workers.get(worker_id)
        stamps = [r.stats.last_message_at for r in entry[1]] if entry else []
        last = max((t for t in stamps if t is not None), default=None)
        return None if last is None else max(0.0, self._clock() - last)

    def _ranks(self) -> Iterable[WorkerRank]:
        for _, ranks in self._workers.values():
            yield from ranks

    # ---------------------------------------------------------------- commands

    async def _submit(self, kind: str, arg: Any) -> None:
        if self._closed or self._closing:
            raise SubscriberError("subscriber is closed")
        if self._task is None or self._task.done():
            self._execute(kind, arg)  # no writer task: nobody else touches the sockets
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commands.append((kind, arg, fut))
        self._sockets.wakeup()
        await fut

    def _post(self, kind: str, arg: Any) -> None:
        if self._task is None or self._task.done():
            self._execute(kind, arg)
        else:
            self._commands.append((kind, arg, None))
            self._sockets.wakeup()

    def _run_commands(self) -> None:
        while self._commands:
            kind, arg, fut = self._commands.popleft()
            try:
                self._execute(kind, arg)
            except Exception as exc:
                if fut is None:
                    log.exception("subscriber command %s failed", kind)
                elif not fut.done():
                    fut.set_exception(exc)
                continue
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _execute(self, kind: str, arg: Any) -> None:
        if kind == "add":
            self._do_add(arg)
        elif kind == "remove":
            self._do_remove(arg)
        elif kind == "sent":
            self._index.record_sent(*arg)
        elif kind == "capacity":
            self._index.set_rank_capacity(*arg)
        elif kind == "source":
            self._do_source(*arg)
        else:
            self._do_restore(arg)

    def _do_add(self, ep: WorkerEndpoint) -> None:
        known = self._workers.get(ep.id)
        if known is not None:
            if known[0] == ep:
                return
            raise SubscriberError(f"worker {ep.id!r} is already registered differently")
        ranks: list[WorkerRank] = []
        held = self._restored.held(ep.id)  # (a snapshot's: only this task adds ranks)
        self._restored.drop_unconfigured(ep, held)
        if ep.events_endpoint is None:  # no stream: approximate ranks, no sockets
            self._restored.unverifiable(ep.id, held)
            for rank in range(ep.dp_ranks):
                self._index.add_worker(ep.id, rank, model=ep.model)
                self._index.set_approximate((ep.id, rank))
            self._workers[ep.id] = (ep, ranks)
            return
        try:
            for rank in range(ep.dp_ranks):
                self._index.add_worker(ep.id, rank, model=ep.model)
                r = WorkerRank(ep, rank)
                ranks.append(r)
                self._sockets.open_rank(r, self._stream.drain_sub, self._stream.drain_mon)
                self._restored.claim(r, r.key in held)
        except Exception as exc:
            for r in ranks:
                self._close_rank(r)
            self._index.remove_worker(ep.id)
            if isinstance(exc, zmq.ZMQError):
                raise SubscriberError(f"cannot subscribe to {ep!r}: {exc}") from exc
            raise
        self._workers[ep.id] = (ep, ranks)

    def _do_source(self, key: WorkerKey, approximate: bool, keep: bool) -> None:
        entry = self._workers.get(key[0])
        r = next((x for x in entry[1] if x.key == key), None) if entry is not None else None
        if r is None:  # gone, or without events (no ranks here): nothing to switch
            return
        self._index.set_approximate(key, approximate, keep)
        if approximate or r.replay_ep is None:
            return  # (without a replay endpoint the live events rebuild it from now on)
        if r.replay is not None:
            self._replays.abort(r)
        # a fresh stream: take all the publisher holds, as a joining rank does
        r.last, r.last_ts, r.covered = UNANCHORED, None, None
        self._replays.start(r, 0, None, join=False)

    def _do_remove(self, worker_id: str) -> None:
        entry = self._workers.pop(worker_id, None)
        if entry is not None:
            for r in entry[1]:
                self._close_rank(r)
        # also a worker known only from a restored snapshot
        self._index.remove_worker(worker_id)
        self._restored.forget(worker_id)

    def _do_restore(self, seqs: dict[WorkerKey, int]) -> None:
        for key, seq in seqs.items():
            entry = self._workers.get(key[0])
            r = next((x for x in entry[1] if x.rank == key[1]), None) if entry else None
            if r is None:
                self._restored.seqs[key] = seq  # applied when the worker is added
                continue
            if r.replay is not None:
                self._replays.abort(r)
            r.live_last = -1
            self._restored.resume(r, seq, join=False)

    def _close_rank(self, r: WorkerRank) -> None:
        if r.replay is not None:
            self._replays.abort(r)
        self._sockets.close_rank(r)

    def _after_replay(
        self, r: WorkerRank, buffered: list[EventBatch], covered: tuple[int, int] | None
    ) -> None:
        # Replays are made before the stream rules (which start them); this defers the lookup.
        self._stream.after_replay(r, buffered, covered)

    # ---------------------------------------------------------------- the task

    async def _run(self) -> None:
        sockets, ready = self._sockets, self._sockets.ready
        loop, window = asyncio.get_running_loop(), sockets.batch_window
        woken = [-window, -window]  # loop times of the last two wake-ups by a SUB
        while True:
            try:
                if self._commands:
                    self._run_commands()
                if self._closing:
                    break
                timeout = self._replays.check_deadlines() if self._replays.running else None
                if not ready:
                    await sockets.wait(timeout)
                    continue
                batch = list(ready)
                ready.clear()
                for w in batch:
                    if w.closed:
                        continue
                    try:
                        more = w.drain(w.owner)
                    except Exception:  # a bug must not stop the other workers' streams
                        log.exception("subscriber: draining %s failed", w.owner.key)
                        sockets.on_fd(w)  # requeue it if it still holds messages
                        continue
                    if more and not w.closed:
                        ready[w] = None
                if window > 0 and not sockets.held and any(map(sockets.is_sub, batch)):
                    # three wake-ups within a window: the fleet is busy, read it once per window
                    now = loop.time()
                    if now - woken[0] < window:
                        sockets.hold()
                    woken[0], woken[1] = woken[1], now
                if self._index.capped:
                    self._index.enforce_cap()
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("subscriber loop error")
                await asyncio.sleep(0.01)
        for _, _, fut in self._commands:
            if fut is not None and not fut.done():
                fut.set_exception(SubscriberError("subscriber is closed"))
        self._commands.clear()


def _resume_point(rank: WorkerRank) -> ResumePoint | None:
    return ResumePoint(rank.last, rank.last_ts) if rank.last >= 0 else None
