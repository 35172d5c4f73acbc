"""The ZMQ subscriber: the event plane's edge and the prefix index's only writer.

For every worker and dp rank it owns a SUB socket on the worker's event endpoint (rank r on base
port + r), a socket monitor that says when that connection is up, and, while a replay runs, a
DEALER on the replay endpoint (also base port + r). One asyncio task owns them all and is the only
code that mutates the index; ``add_worker``/``remove_worker``/``restore_seqs`` are commands to it.
What to do with each batch (apply, replay, skip, drop) is ``indexer.subscriber_stream`` (the
rules) and ``indexer.subscriber_replay`` (replays, and telling a new publisher process).

Sockets are plain pyzmq sockets driven from asyncio: each ``zmq.FD`` is registered with the loop,
a ready socket is drained with ``NOBLOCK`` receives (bounded per round so one worker cannot starve
the others), and the task yields to the loop after every round: no future per message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import zmq

from indexer.events import EventBatch, ResumePoint
from indexer.subscriber_replay import ReplayLogic
from indexer.subscriber_state import (
    SubscriberError,
    Watch,
    WorkerEndpoint,
    WorkerRank,
    WorkerStats,
    rank_endpoint,
)
from indexer.wire import decode_message

if TYPE_CHECKING:
    from indexer.index import PrefixIndex, WorkerKey

__all__ = ["Subscriber", "SubscriberError", "WorkerEndpoint", "WorkerStats", "rank_endpoint"]

_log = logging.getLogger(__name__)

_DRAIN_CAP = 512  # messages per socket per round
_MON_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int skips pyzmq's per-call flag enum conversion


class Subscriber(ReplayLogic):
    """Subscribes to every worker's KV event stream and applies it to ``index``."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        context: zmq.Context[Any] | None = None,
        replay_timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
        rcvhwm: int = 100_000,
        max_buffered: int = 100_000,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self._index = index
        self._own_ctx = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        self._replay_timeout = replay_timeout
        self._clock = clock
        self._rcvhwm = rcvhwm
        self._max_buffered = max_buffered
        # ZMQ_MAXMSGSIZE of publisher-facing sockets: a peer sending more is cut off unbuffered
        self._max_message_bytes = max_message_bytes
        self._workers: dict[str, tuple[WorkerEndpoint, list[WorkerRank]]] = {}
        self._restored: dict[tuple[str, int], int] = {}
        self._ready: dict[Watch, None] = {}
        self._replaying: set[WorkerRank] = set()
        self._commands: deque[tuple[str, Any, asyncio.Future[None] | None]] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        self._mon_ids = itertools.count()

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
        self._wakeup()
        if self._task is not None:
            await self._task
        self._closed = True
        for _, ranks in self._workers.values():
            for r in ranks:
                self._close_rank(r)
        self._workers.clear()
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    async def add_worker(self, ep: WorkerEndpoint) -> None:
        """Subscribe to ``ep`` (every dp rank). Returns once its sockets are connecting."""
        if not ep.worker_id or ep.dp_ranks < 1:
            raise SubscriberError(f"invalid worker endpoint {ep!r}")
        for rank in range(ep.dp_ranks):
            rank_endpoint(ep.events, rank)
            if ep.replay is not None:
                rank_endpoint(ep.replay, rank)
        await self._submit("add", ep)

    async def remove_worker(self, worker_id: str) -> None:
        """Unsubscribe ``worker_id`` and drop its index entries (every dp rank)."""
        await self._submit("remove", worker_id)

    def restore_seqs(self, seqs: Mapping[WorkerKey, int]) -> None:
        """After ``PrefixIndex.restore``: resume each rank (added now or later) at its snapshotted
        seq, checked to come from the same publisher process (else its entries are rebuilt); a
        gap the publisher can no longer replay drops that rank's entries."""
        self._post("restore", dict(seqs))

    def stats(self) -> dict[WorkerKey, WorkerStats]:
        """Per (worker_id, dp_rank) stats, refreshed from the index (the objects are live)."""
        return {
            r.key: r.refreshed_stats(self._index)
            for _, ranks in self._workers.values()
            for r in ranks
        }

    def resume_points(self) -> dict[WorkerKey, ResumePoint]:
        """Per worker rank: the last applied seq and its batch's ts, what a snapshot records."""
        return {
            r.key: ResumePoint(r.last, r.last_ts)
            for _, ranks in self._workers.values()
            for r in ranks
            if r.last >= 0
        }

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

    def seconds_since_last_message(self, worker_id: str) -> float | None:
        """Freshness: seconds since any rank of the worker last sent a message (None: never)."""
        entry = self._workers.get(worker_id)
        stamps = [r.stats.last_message_at for r in entry[1]] if entry else []
        last = max((t for t in stamps if t is not None), default=None)
        return None if last is None else max(0.0, self._clock() - last)

    # ---------------------------------------------------------------- commands

    async def _submit(self, kind: str, arg: Any) -> None:
        if self._closed or self._closing:
            raise SubscriberError("subscriber is closed")
        if self._task is None or self._task.done():
            self._execute(kind, arg)  # no writer task: nobody else touches the sockets
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commands.append((kind, arg, fut))
        self._wakeup()
        await fut

    def _post(self, kind: str, arg: Any) -> None:
        if self._task is None or self._task.done():
            self._execute(kind, arg)
        else:
            self._commands.append((kind, arg, None))
            self._wakeup()

    def _run_commands(self) -> None:
        while self._commands:
            kind, arg, fut = self._commands.popleft()
            try:
                self._execute(kind, arg)
            except Exception as exc:
                if fut is None:
                    _log.exception("subscriber command %s failed", kind)
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
        else:
            self._do_restore(arg)

    def _do_add(self, ep: WorkerEndpoint) -> None:
        known = self._workers.get(ep.worker_id)
        if known is not None:
            if known[0] == ep:
                return
            raise SubscriberError(f"worker {ep.worker_id!r} is already registered differently")
        ranks: list[WorkerRank] = []
        try:
            for rank in range(ep.dp_ranks):
                self._index.add_worker(ep.worker_id, rank, model=ep.model)
                r = WorkerRank(ep, rank)
                ranks.append(r)
                self._open_rank(r)
                seq = self._restored.pop(r.key, None)
                if seq is not None:
                    r.last, r.last_ts = int(seq), getattr(seq, "ts", None)
                if r.replay_ep is not None:
                    self._resume(r, join=True)
                else:
                    r.stats.replay_done = True
        except Exception as exc:
            for r in ranks:
                self._close_rank(r)
            self._index.remove_worker(ep.worker_id)
            if isinstance(exc, zmq.ZMQError):
                raise SubscriberError(f"cannot subscribe to {ep!r}: {exc}") from exc
            raise
        self._workers[ep.worker_id] = (ep, ranks)

    def _do_remove(self, worker_id: str) -> None:
        entry = self._workers.pop(worker_id, None)
        if entry is not None:
            for r in entry[1]:
                self._close_rank(r)
        # also a worker known only from a restored snapshot
        self._index.remove_worker(worker_id)
        for key in [k for k in self._restored if k[0] == worker_id]:
            del self._restored[key]

    # ------------------------------------------------------------------ sockets

    def _open_rank(self, r: WorkerRank) -> None:
        loop = asyncio.get_running_loop()
        sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB, socket_class=zmq.Socket)
        r.sub = Watch(sub, self._drain_sub, r)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        addr = f"inproc://kvrouter-subscriber-monitor-{id(self):x}-{next(self._mon_ids)}"
        sub.monitor(addr, _MON_EVENTS)
        mon: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        r.mon = Watch(mon, self._drain_mon, r)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(addr)
        sub.connect(r.events_ep)
        if r.events_ep.startswith("inproc://"):  # no handshake, so no monitor event, in-process
            r.stats.connected = r.ever_connected = True
        for w in (r.sub, r.mon):
            loop.add_reader(w.fd, self._on_fd, w)
            self._on_fd(w)

    def _close_watch(self, w: Watch | None) -> None:
        if w is None or w.closed:
            return
        w.closed = True
        self._ready.pop(w, None)
        try:
            asyncio.get_running_loop().remove_reader(w.fd)
        except RuntimeError:  # no running loop (closing outside one): nothing is registered
            pass
        w.sock.close(linger=0)

    def _close_rank(self, r: WorkerRank) -> None:
        if r.replay is not None:
            self._abort_replay(r)
        if r.sub is not None and not r.sub.closed:
            try:
                r.sub.sock.disable_monitor()
            except zmq.ZMQError:
                pass
        self._close_watch(r.mon)
        self._close_watch(r.sub)

    def _on_fd(self, w: Watch) -> None:
        # ZMQ_FD is edge-like: reading ZMQ_EVENTS resets it, so check here and queue the socket.
        if w.closed:
            return
        try:
            events: int = w.sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
        except zmq.ZMQError:
            return
        if events & zmq.POLLIN:
            self._ready[w] = None
            self._wakeup()

    def _wakeup(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    # ---------------------------------------------------------------- the task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                if self._commands:
                    self._run_commands()
                if self._closing:
                    break
                timeout = self._check_deadlines() if self._replaying else None
                if not self._ready:
                    await self._wait(loop, timeout)
                    continue
                batch = list(self._ready)
                self._ready.clear()
                for w in batch:
                    if w.closed:
                        continue
                    try:
                        more = w.drain(w.owner)
                    except Exception:  # a bug must not stop the other workers' streams
                        _log.exception("subscriber: draining %s failed", w.owner.key)
                        self._on_fd(w)  # requeue it if it still holds messages
                        continue
                    if more and not w.closed:
                        self._ready[w] = None
                if self._index.max_entries:
                    self._index.enforce_cap()
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except Exception:
                _log.exception("subscriber loop error")
                await asyncio.sleep(0.01)
        for _, _, fut in self._commands:
            if fut is not None and not fut.done():
                fut.set_exception(SubscriberError("subscriber is closed"))
        self._commands.clear()

    async def _wait(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        wake = self._wake = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, self._wakeup)
        try:
            await wake
        finally:
            self._wake = None
            if timer is not None:
                timer.cancel()

    # ------------------------------------------------------------ live stream

    def _drain_sub(self, r: WorkerRank) -> bool:
        # The hot path: keep per-message work to a recv, a decode, a compare and the index call.
        recv = r.sub.sock.recv_multipart  # type: ignore[union-attr]
        apply = self._index.apply_batch
        wid, rank, st = r.worker_id, r.rank, r.stats
        n = applied = 0
        last_batch: EventBatch | None = None
        while n < _DRAIN_CAP:
            try:
                frames = recv(_NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                batch = decode_message(frames)
            except Exception as exc:  # WireError, or a decoder bug: this message is lost either way
                self._malformed(r, exc)
                continue
            last_batch = batch
            if batch.seq == r.last + 1 and r.fast:
                r.last = r.live_last = batch.seq
                r.last_ts = batch.ts
                try:
                    apply(wid, batch, dp_rank=rank)
                except Exception as exc:
                    self._apply_failed(r, batch, exc)
                applied += 1
                if batch.unknown_events:
                    st.unknown_events += batch.unknown_events
            else:
                try:
                    self._on_live(r, batch)
                except Exception as exc:
                    self._apply_failed(r, batch, exc)
        st.messages += applied
        if n:
            now = self._clock()
            st.last_message_at = now
            if last_batch is not None:
                st.lag_s = now - last_batch.ts
        return n == _DRAIN_CAP
