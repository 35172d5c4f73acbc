"""The subscriber's sequence logic and replays: per worker rank, apply, replay, skip or drop.

``indexer.subscriber.Subscriber`` owns the sockets and the task and inherits this; every method
here runs on that task and is synchronous. Rules (docs/architecture.md §4):

- live ``seq == last + 1``: apply. ``seq > last + 1``: a gap; replay ``[last + 1, seq)`` through
  the DEALER while live batches wait in a buffer, or, with no replay endpoint, drop the rank.
- a live seq at or below the previous live seq: the publisher restarted; drop, then start over
  from 0 (replaying what the new process already sent, if needed).
- replay replies apply only seqs in ``(last, target)``; a hole in them, a timeout, or an end short
  of ``target - 1`` drops the rank's entries (``index.clear_worker``) and marks it untrusted.
- after a replay, buffered live batches the replay already covered are skipped; nothing is
  applied twice, and a rank's batches are applied in seq order.
- a new publisher process is detected on every (re)connect and snapshot resume, not only when a
  live seq goes backwards: the replay then starts at the last *applied* seq, and its first reply
  must be that same batch (same ``ts``). Another batch under that seq, a later seq, or no reply at
  all means the process that seq came from is gone: the rank's entries are dropped and the new
  process's stream is replayed from 0 (a restart, the rank stays trusted). Without a replay
  endpoint only a live seq going backwards can show a restart.

Trust rule: a rank whose entries were dropped because events were lost (a gap replay could not
close, a replay timeout) is ``trusted=False`` until it applies, in order, a live batch newer than
every batch seen when the entries were dropped. A publisher restart drops the entries too but
leaves the rank trusted: its cache really is empty.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import zmq

from indexer.events import EventBatch
from indexer.subscriber_state import UNANCHORED, Watch, WorkerEndpoint, WorkerRank

if TYPE_CHECKING:
    from indexer.index import PrefixIndex

__all__ = ["StreamLogic"]

_log = logging.getLogger("indexer.subscriber")

_LOG_EVERY_S = 10.0
_DRAIN_CAP = 512  # replies per round
_NOBLOCK = int(zmq.NOBLOCK)
_MON_HEADER = struct.Struct("=Hi")  # monitor event frame: event id, value


class StreamLogic:
    """Sequence decisions of the subscriber (a base class: the socket side lives in the subclass)."""

    _index: PrefixIndex
    _ctx: zmq.Context[Any]
    _clock: Callable[[], float]
    _replay_timeout: float
    _max_buffered: int
    _max_message_bytes: int
    _replaying: set[WorkerRank]
    _workers: dict[str, tuple[WorkerEndpoint, list[WorkerRank]]]
    _restored: dict[tuple[str, int], int]

    def _on_fd(self, w: Watch) -> None:
        raise NotImplementedError

    def _close_watch(self, w: Watch | None) -> None:
        raise NotImplementedError

    # implemented by ``subscriber_replay.ReplayLogic``
    def _start_replay(
        self, r: WorkerRank, start: int, target: int | None, *, join: bool, verify: bool = False
    ) -> None:
        raise NotImplementedError

    def _abort_replay(self, r: WorkerRank) -> None:
        raise NotImplementedError

    def _finish_replay(self, r: WorkerRank, error: str | None) -> None:
        raise NotImplementedError

    def _send_replay(self, r: WorkerRank) -> None:
        raise NotImplementedError

    def _resume(self, r: WorkerRank, *, join: bool) -> None:
        raise NotImplementedError

    def _apply(self, r: WorkerRank, batch: EventBatch) -> None:
        st = r.stats
        r.last_ts = batch.ts
        try:
            self._index.apply_batch(r.worker_id, batch, dp_rank=r.rank)
        except Exception as exc:
            self._apply_failed(r, batch, exc)
        st.messages += 1
        if batch.unknown_events:
            st.unknown_events += batch.unknown_events

    def _apply_failed(self, r: WorkerRank, batch: EventBatch, exc: Exception) -> None:
        r.stats.apply_errors += 1
        self._log_limited(r, logging.WARNING, "index rejected batch seq %d: %r", batch.seq, exc)

    def _on_live(self, r: WorkerRank, batch: EventBatch) -> None:
        if batch.seq <= r.live_last:  # the live stream went backwards: a new publisher process
            self._restart(r, batch)
            return
        r.live_last = batch.seq
        rp = r.replay
        if rp is None:
            self._ordered(r, batch, None)
        elif len(rp.buffer) < self._max_buffered:
            rp.buffer.append(batch)
        else:
            rp.buffer.append(batch)
            self._finish_replay(r, "live buffer overflow while replaying")

    def _ordered(self, r: WorkerRank, batch: EventBatch, covered: tuple[int, int] | None) -> None:
        """Apply one live batch in sequence order (no replay running for ``r``)."""
        s, last, st = batch.seq, r.last, r.stats
        if s == last + 1 or last == UNANCHORED:
            r.last = s
            self._apply(r, batch)
            if not st.trusted and s == last + 1 and s > r.trust_after:
                st.trusted = True
        elif s > last + 1:
            st.gaps += 1
            if r.replay_ep is not None:
                self._start_replay(r, last + 1, s, join=False)
                r.replay.buffer.append(batch)  # type: ignore[union-attr]
            else:
                self._drop(r, f"gap {last + 1}..{s - 1} and no replay endpoint")
                r.last = s
                self._apply(r, batch)
        elif covered is not None and covered[0] <= s <= covered[1]:
            st.skipped += 1  # buffered while replaying and already applied from the replay
            return
        else:
            self._restart(r, batch)
        r.fast = r.replay is None and st.trusted

    def _restart(self, r: WorkerRank, batch: EventBatch) -> None:
        if r.replay is not None:
            self._abort_replay(r)  # it was replaying the previous process's stream
        self._clear(r)
        st = r.stats
        st.restarts += 1
        st.trusted = True
        r.last, r.live_last, r.trust_after, r.last_ts = -1, batch.seq, -1, None
        _log.info("worker %s rank %d restarted (seq %d)", r.worker_id, r.rank, batch.seq)
        self._ordered(r, batch, None)

    def _clear(self, r: WorkerRank) -> None:
        r.clears += 1
        try:
            self._index.clear_worker(r.worker_id, r.rank)
        except Exception as exc:
            st = r.stats
            st.apply_errors += 1
            self._log_limited(r, logging.WARNING, "index clear failed: %r", exc)

    def _drop(self, r: WorkerRank, why: str) -> None:
        """Events were lost for good: drop the rank's entries until fresh events rebuild them."""
        self._clear(r)
        st = r.stats
        st.replay_failures += 1
        st.trusted = False
        r.fast = False
        r.trust_after = max(r.live_last, r.last)
        _log.warning("worker %s rank %d entries dropped: %s", r.worker_id, r.rank, why)

    def _malformed(self, r: WorkerRank, exc: Exception) -> None:
        r.stats.malformed += 1
        self._log_limited(r, logging.DEBUG, "malformed message dropped: %s", exc)

    def _log_limited(self, r: WorkerRank, level: int, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now >= r.next_log:
            r.next_log = now + _LOG_EVERY_S
            _log.log(level, "worker %s rank %d: " + msg, r.worker_id, r.rank, *args)

    def _replay_buffered(
        self, r: WorkerRank, buffered: Iterable[EventBatch], covered: tuple[int, int] | None
    ) -> None:
        items = list(buffered)
        for i, batch in enumerate(items):
            if r.replay is not None:  # a gap inside the buffer started another replay
                r.replay.buffer.extend(items[i:])
                return
            self._ordered(r, batch, covered)
        r.fast = r.replay is None and r.stats.trusted

    def _on_connected(self, r: WorkerRank) -> None:
        r.stats.connected = True
        rp = r.replay
        if rp is not None:
            if not rp.sent:
                self._send_replay(r)
        elif r.ever_connected and r.replay_ep is not None and r.last >= -1:
            # Reconnected: ask for what was published while the connection was down, from a
            # new process if that is what answers.
            self._resume(r, join=False)
        r.ever_connected = True

    def _do_restore(self, seqs: dict[tuple[str, int], int]) -> None:
        for key, seq in seqs.items():
            entry = self._workers.get(key[0])
            r = next((x for x in entry[1] if x.rank == key[1]), None) if entry else None
            if r is None:
                self._restored[key] = seq
                continue
            if r.replay is not None:
                self._abort_replay(r)
            r.last, r.live_last, r.last_ts = int(seq), -1, getattr(seq, "ts", None)
            if r.replay_ep is not None:
                self._resume(r, join=False)

    def _redial(self, r: WorkerRank) -> None:
        """Connect again ourselves: libzmq does not reconnect after a protocol error, and a
        message over ZMQ_MAXMSGSIZE is one; a fresh connect retries like its own reconnect."""
        if r.sub is None or r.sub.closed:
            return
        sock = r.sub.sock
        try:
            sock.disconnect(r.events_ep)
        except zmq.ZMQError:
            pass  # the session is gone already (a protocol error terminates it)
        try:
            sock.connect(r.events_ep)
        except zmq.ZMQError as exc:
            self._log_limited(r, logging.WARNING, "reconnect failed: %r", exc)

    def _drain_mon(self, r: WorkerRank) -> bool:
        sock = r.mon.sock  # type: ignore[union-attr]
        for _ in range(_DRAIN_CAP):
            try:
                frames = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return False
            if len(frames[0]) != _MON_HEADER.size:
                continue
            event = _MON_HEADER.unpack(frames[0])[0]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._on_connected(r)
            elif event == zmq.EVENT_DISCONNECTED:
                r.stats.connected = False
                self._redial(r)
        return True
