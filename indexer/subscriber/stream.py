"""The live stream's rules: per worker rank, what to do with each batch its SUB delivers (apply,
replay the gap, skip, start over) and with its connection's ups and downs. Runs on the subscriber
task; replays are ``indexer.subscriber.replay``'s. Rules (docs/architecture.md §4):

- live ``seq == last + 1``: apply. ``seq > last + 1``: a gap; replay ``[last + 1, seq)`` while live
  batches wait in the replay's buffer, or, with no replay endpoint, drop the rank's entries.
- a live seq at or below the previous live seq: the publisher restarted; clear, then start over
  from 0 (replaying what the new process already sent, if needed).
- after a replay, live batches the replay already covered are skipped, whether they were buffered
  while it ran or read after it ended (above the last live seq: their live copies were still
  queued); nothing is applied twice, and a rank's batches are applied in seq order.
- a reconnect resumes through a replay that first checks the publisher is the same process.
  Without a replay endpoint only a live seq going backwards can show a restart.
- a dropped rank is untrusted until an in-order live batch newer than every batch seen when its
  entries were dropped is applied (``indexer.subscriber.writer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import zmq

from indexer.events import EventBatch
from indexer.subscriber.records import UNANCHORED, WorkerRank, log
from indexer.subscriber.replay import Replays
from indexer.subscriber.sockets import DRAIN_CAP, Sockets, monitor_event, receive
from indexer.subscriber.writer import IndexWriter
from indexer.wire import decode_message

if TYPE_CHECKING:
    from indexer.index import PrefixIndex

__all__ = ["StreamRules"]


class StreamRules:
    """Sequence decisions for every rank's live stream, and its connection events."""

    def __init__(
        self,
        index: PrefixIndex,
        writer: IndexWriter,
        replays: Replays,
        sockets: Sockets,
        *,
        clock: Callable[[], float],
        max_buffered: int,
    ) -> None:
        self._index = index
        self._writer = writer
        self._replays = replays
        self._sockets = sockets
        self._clock = clock
        self._max_buffered = max_buffered

    def drain_sub(self, r: WorkerRank) -> bool:
        """Drain rank ``r``'s SUB; True when more may be waiting."""
        # The hot path: keep per-message work to a decode, a compare and the index call.
        apply = self._index.apply_batch
        wid, rank, st = r.worker_id, r.rank, r.stats
        msgs = receive(r.sub.sock)  # type: ignore[union-attr]
        applied = 0
        last_batch: EventBatch | None = None
        for frames in msgs:
            try:
                batch = decode_message(frames)
            except Exception as exc:  # WireError, or a decoder bug: this message is lost either way
                self._writer.malformed(r, exc)
                continue
            last_batch = batch
            if batch.seq == r.last + 1 and r.fast:
                r.last = r.live_last = batch.seq
                r.last_ts = batch.ts
                try:
                    apply(wid, batch, dp_rank=rank)
                except Exception as exc:
                    self._writer.apply_failed(r, batch, exc)
                applied += 1
                if batch.unknown_events:
                    st.unknown_events += batch.unknown_events
            else:
                try:
                    self._on_live(r, batch)
                except Exception as exc:
                    self._writer.apply_failed(r, batch, exc)
        st.messages += applied
        if applied:
            self._writer.applied(r)
        if msgs:
            now = self._clock()
            st.last_message_at = now
            if last_batch is not None:
                st.lag_s = now - last_batch.ts
        return len(msgs) == DRAIN_CAP

    def drain_mon(self, r: WorkerRank) -> bool:
        """Drain rank ``r``'s connection monitor; True when more may be waiting."""
        msgs = receive(r.mon.sock)  # type: ignore[union-attr]
        for frames in msgs:
            event = monitor_event(frames)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._on_connected(r)
            elif event == zmq.EVENT_DISCONNECTED:
                r.stats.connected = False
                self._sockets.redial(r)
        return len(msgs) == DRAIN_CAP

    def after_replay(
        self, r: WorkerRank, buffered: Iterable[EventBatch], covered: tuple[int, int] | None
    ) -> None:
        """A replay ended: the live batches it buffered, in order, skipping those in ``covered``
        (the seqs its replies brought)."""
        items = list(buffered)
        r.covered = covered
        for i, batch in enumerate(items):
            if r.replay is not None:  # a gap inside the buffer started another replay
                r.replay.buffer.extend(items[i:])
                return
            self._ordered(r, batch)
        r.fast = r.replay is None and r.stats.trusted

    def _on_live(self, r: WorkerRank, batch: EventBatch) -> None:
        if batch.seq <= r.live_last:  # the live stream went backwards: a new publisher process
            self._restart(r, batch)
            return
        r.live_last = batch.seq
        rp = r.replay
        if rp is None:
            self._ordered(r, batch)
        elif len(rp.buffer) < self._max_buffered:
            rp.buffer.append(batch)
        else:
            rp.buffer.append(batch)
            self._replays.finish(r, "live buffer overflow while replaying")

    def _ordered(self, r: WorkerRank, batch: EventBatch) -> None:
        """Apply one live batch in sequence order (no replay running for ``r``); one that
        ``r.covered`` (its last replay) already brought is skipped."""
        s, last, st = batch.seq, r.last, r.stats
        if s == last + 1 or last == UNANCHORED:
            r.last = s
            self._writer.apply(r, batch)
            if not st.trusted and s == last + 1 and s > r.trust_after:
                st.trusted = True
        elif s > last + 1:
            st.gaps += 1
            if r.replay_ep is not None:
                self._replays.start(r, last + 1, s, join=False)
                r.replay.buffer.append(batch)  # type: ignore[union-attr]
            else:
                self._writer.drop(r, f"gap {last + 1}..{s - 1} and no replay endpoint")
                r.last = s
                self._writer.apply(r, batch)
        elif (covered := r.covered) is not None and covered[0] <= s <= covered[1]:
            st.skipped += 1  # a live copy of what the replay applied (buffered, or read late)
            return
        else:
            self._restart(r, batch)
        r.fast = r.replay is None and st.trusted

    def _restart(self, r: WorkerRank, batch: EventBatch) -> None:
        if r.replay is not None:
            self._replays.abort(r)  # it was replaying the previous process's stream
        self._writer.clear(r)
        r.covered = None
        st = r.stats
        st.restarts += 1
        st.trusted = True
        r.last, r.live_last, r.trust_after, r.last_ts = -1, batch.seq, -1, None
        log.info("worker %s rank %d restarted (seq %d)", r.worker_id, r.rank, batch.seq)
        self._ordered(r, batch)

    def _on_connected(self, r: WorkerRank) -> None:
        r.stats.connected = True
        rp = r.replay
        if rp is not None:
            if not rp.sent:
                self._replays.send(r)
        elif r.ever_connected and r.replay_ep is not None and r.last >= -1:
            # Reconnected: ask for what was published while the connection was down, from a
            # new process if that is what answers.
            self._replays.resume(r, join=False)
        r.ever_connected = True
