"""The subscriber's replays: asking a publisher's ROUTER for seqs from a point on (a DEALER per
replay in flight), applying the replies in order, telling a new publisher process from the old
one, and giving up on time. Everything runs on the subscriber task. Rules (docs/architecture.md §4):

- replay replies apply only seqs in ``(last, target)``; a hole in them, a timeout, or an end short
  of ``target - 1`` drops the rank's entries (``IndexWriter.drop``) and marks it untrusted.
- a new publisher process is detected on every (re)connect and snapshot resume (``resume``): the
  replay then starts at the last *applied* seq, and its first reply must be that same batch (same
  ``ts``). Another batch under that seq, a later seq, or no reply at all means the process that
  seq came from is gone: the rank's entries are cleared and the new process's stream is replayed
  from 0 (a restart, the rank stays trusted).
- a rank restored from a snapshot reconciles (``resume(reconcile=True)``): its replay asks from
  seq 0. When the publisher still holds its whole stream (the first reply is seq 0), the
  snapshot's part of the rank is not needed and not trusted: it is cleared and rebuilt from the
  stream (a made-up block in a peer's snapshot goes here); else the replies before the applied
  seq are skipped and the applied seq's batch is checked as above.
- live batches that arrive meanwhile wait in the replay's buffer; when the replay ends they go,
  with the seqs the replies covered, to ``then`` (the stream rules), which skips what was applied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from indexer.events import EventBatch
from indexer.subscriber.records import UNANCHORED, Replay, WorkerRank, log, log_limited
from indexer.subscriber.sockets import DRAIN_CAP, NOBLOCK, Sockets, receive
from indexer.subscriber.writer import IndexWriter
from indexer.wire import decode_payload, decode_replay_reply, encode_replay_request

__all__ = ["Replays"]

#: After a replay: (rank, the live batches buffered meanwhile, seqs the replies covered or None).
Then = Callable[[WorkerRank, list[EventBatch], tuple[int, int] | None], None]


class Replays:
    """Every rank's replay in flight: started, sent, drained, timed out and ended here."""

    def __init__(
        self,
        writer: IndexWriter,
        sockets: Sockets,
        *,
        clock: Callable[[], float],
        timeout: float,
        then: Then,
    ) -> None:
        self._writer = writer
        self._sockets = sockets
        self._clock = clock
        self._timeout = timeout
        self._then = then
        #: Ranks whose replay request was sent and is not over: the ones with deadlines.
        self.running: set[WorkerRank] = set()
        #: Restored ranks rebuilt from their publisher's whole stream (``resume(reconcile)``).
        self.rebuilt = 0

    def resume(self, r: WorkerRank, *, join: bool, reconcile: bool = False) -> None:
        """Replay what was published after the last applied seq, checking first that the
        publisher is still the process that seq came from; ``reconcile`` (a snapshot's rank):
        from seq 0, to rebuild the rank from the whole stream when the publisher still has it
        (see the module rules)."""
        if r.last >= 0 and r.last_ts is not None:
            start = 0 if reconcile else r.last
            self.start(r, start, None, join=join, verify=True, reconcile=reconcile)
        else:
            self.start(r, r.last + 1 if r.last >= 0 else 0, None, join=join)

    def start(
        self,
        r: WorkerRank,
        start: int,
        target: int | None,
        *,
        join: bool,
        verify: bool = False,
        reconcile: bool = False,
    ) -> None:
        """Replay seqs ``[start, target)`` (target None: all the publisher has); the request is
        sent now if the rank is connected, else on connect (``send``)."""
        r.replay = Replay(start, target, join, verify)
        r.replay.reconcile = reconcile
        r.fast = False
        r.stats.replays += 1
        if r.stats.connected:
            self.send(r)

    def send(self, r: WorkerRank) -> None:
        rp = r.replay
        assert rp is not None and r.replay_ep is not None
        rp.sent = True
        now = time.monotonic()
        rp.deadline = now + self._timeout
        rp.hard_deadline = now + 10 * self._timeout
        self.running.add(r)
        try:
            r.dealer = self._sockets.open_dealer(r, r.replay_ep, self._drain)
            r.dealer.sock.send_multipart(encode_replay_request(rp.start), NOBLOCK)
        except (zmq.ZMQError, ValueError, OverflowError) as exc:
            self.finish(r, f"replay request failed: {exc}")
            return
        self._sockets.on_fd(r.dealer)

    def abort(self, r: WorkerRank) -> None:
        """Forget ``r``'s replay (its buffer too) and close its DEALER."""
        if r.replay is not None and r.replay.join:
            r.stats.replay_done = True
        r.replay = None
        self.running.discard(r)
        self._sockets.close(r.dealer)
        r.dealer = None
        r.fast = r.stats.trusted

    def finish(self, r: WorkerRank, error: str | None) -> None:
        """End ``r``'s replay (``error``: why it fell short) and hand the buffered live batches
        to ``then``."""
        rp = r.replay
        if rp is None:
            return
        self.abort(r)
        target = rp.target
        if error is None and target is not None and r.last < target - 1:
            error = f"replay ended at {r.last}, needed up to {target - 1}"
        if error is not None and not rp.failed and (r.last != UNANCHORED or not rp.join):
            self._writer.drop(r, error)
        elif error is not None and not rp.failed:
            r.stats.replay_failures += 1  # joining with nothing to drop
            log.warning("worker %s rank %d: %s", r.worker_id, r.rank, error)
        if target is not None and r.last < target - 1:
            r.last = target - 1
        if r.last == UNANCHORED and error is None:
            r.last = -1  # the publisher has sent nothing yet: its stream starts at 0
        covered = None if rp.lo is None or rp.hi is None else (rp.lo, rp.hi)
        self._then(r, rp.buffer, covered)

    def check_deadlines(self) -> float | None:
        """End the replays past their deadline; seconds until the nearest other one (None: none)."""
        now = time.monotonic()
        nearest: float | None = None
        for r in list(self.running):
            rp = r.replay
            if rp is None:
                continue
            due = min(rp.deadline, rp.hard_deadline)
            if now >= due:
                self.finish(r, "replay timed out")
            elif nearest is None or due - now < nearest:
                nearest = due - now
        return nearest

    # ------------------------------------------------------------- replies

    def _drain(self, r: WorkerRank) -> bool:
        rp = r.replay
        if rp is None or r.dealer is None:
            return False
        # Replies left unread when the replay ends below are dropped with its DEALER anyway.
        msgs = receive(r.dealer.sock)
        for frames in msgs:
            try:
                reply = decode_replay_reply(frames)
            except Exception as exc:
                self._writer.malformed(r, exc)
                continue
            if reply.is_end:  # not an event batch: freshness stays as it was
                if rp.verify:  # (it ended before the applied seq)
                    self._new_process(r, rp, f"replay holds nothing from applied seq {r.last} on")
                    return False
                self.finish(r, None)
                return False
            try:
                self._on_reply(r, rp, reply.seq, reply.payload, reply.topic or b"")
            except Exception as exc:
                log_limited(r, logging.WARNING, "replay reply %d failed: %r", reply.seq, exc)
                r.stats.apply_errors += 1
            if r.replay is not rp:
                return False
        if msgs:
            rp.deadline = time.monotonic() + self._timeout
            r.stats.last_message_at = self._clock()
        return len(msgs) == DRAIN_CAP

    def _on_reply(self, r: WorkerRank, rp: Replay, s: int, payload: bytes, topic: bytes) -> None:
        if rp.reconcile and rp.verify and rp.lo is None and s == 0:
            # reconciling, and the publisher holds its whole stream: rebuild from it alone
            self._writer.clear(r)
            self.rebuilt += 1
            r.last, r.last_ts, rp.verify = -1, None, False
            log.info(
                "worker %s rank %d rebuilt from its publisher's whole stream, not the snapshot",
                r.worker_id,
                r.rank,
            )
        if rp.verify:
            if rp.lo is None:
                rp.lo = s
            rp.hi = s
            if s < r.last and rp.reconcile:
                return  # reconciling: before the applied seq, which is checked below
            if s == r.last:
                try:
                    ts: float | None = decode_payload(payload, seq=s, topic=topic).ts
                except Exception:  # WireError, or a decoder bug: not the batch that was applied
                    ts = None
                if ts == r.last_ts:
                    rp.verify = False
                    return  # the same process: the replies after it continue the stream
            self._new_process(
                r, rp, f"replay answered seq {s} for applied seq {r.last} differently"
            )
            return
        if rp.lo is None:
            rp.lo = s
        rp.hi = s
        if (rp.target is not None and s >= rp.target) or (r.last != UNANCHORED and s <= r.last):
            return  # the live buffer has it / already applied
        try:
            batch = decode_payload(payload, seq=s, topic=topic)
        except Exception as exc:  # WireError, or a decoder bug
            self._writer.malformed(r, exc)
            return
        if r.last == UNANCHORED:
            r.last = s - 1  # joining: take what the publisher still buffers
        elif s > r.last + 1:
            if not rp.failed:
                rp.failed = True
                self._writer.drop(r, f"replay is missing {r.last + 1}..{s - 1}")
            r.last = s - 1
        r.last = s
        self._writer.apply(r, batch)
        st = r.stats
        st.replayed += 1
        st.last_message_at = now = self._clock()
        st.lag_s = now - batch.ts

    def _new_process(self, r: WorkerRank, rp: Replay, why: str) -> None:
        """A verifying replay showed a new publisher process: clear the rank's entries and
        replay the new process's stream from 0, keeping the live batches buffered meanwhile."""
        buffered = rp.buffer
        self.abort(r)
        self._writer.clear(r)
        st = r.stats
        st.restarts += 1
        st.trusted = True
        r.last, r.last_ts, r.trust_after = -1, None, -1
        r.live_last = max((b.seq for b in buffered), default=-1)
        log.info("worker %s rank %d is a new publisher process: %s", r.worker_id, r.rank, why)
        self.start(r, 0, None, join=rp.join)
        if rp.join:
            st.replay_done = False
        r.replay.buffer.extend(buffered)  # type: ignore[union-attr]
