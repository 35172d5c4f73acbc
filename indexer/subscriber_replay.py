"""The subscriber's replays: asking a publisher's ROUTER for seqs from a point on, applying the
replies in order, telling a new publisher process from the old one, and giving up on time.

The rules are ``indexer.subscriber_stream``'s; this is the half of ``StreamLogic`` that talks to
the replay endpoint (a DEALER per replay in flight). Everything runs on the subscriber task.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from indexer.subscriber_state import UNANCHORED, Replay, Watch, WorkerRank
from indexer.subscriber_stream import StreamLogic
from indexer.wire import decode_payload, decode_replay_reply, encode_replay_request

__all__ = ["ReplayLogic"]

_log = logging.getLogger("indexer.subscriber")

_DRAIN_CAP = 512  # replies per round
_NOBLOCK = int(zmq.NOBLOCK)


class ReplayLogic(StreamLogic):
    """Replays (a base class of ``Subscriber``)."""

    def _new_process(self, r: WorkerRank, rp: Replay, why: str) -> None:
        """A verifying replay showed a new publisher process: drop the rank's entries and
        replay the new process's stream from 0, keeping the live batches buffered meanwhile."""
        buffered = rp.buffer
        self._abort_replay(r)
        self._clear(r)
        st = r.stats
        st.restarts += 1
        st.trusted = True
        r.last, r.last_ts, r.trust_after = -1, None, -1
        r.live_last = max((b.seq for b in buffered), default=-1)
        _log.info("worker %s rank %d is a new publisher process: %s", r.worker_id, r.rank, why)
        self._start_replay(r, 0, None, join=rp.join)
        if rp.join:
            st.replay_done = False
        r.replay.buffer.extend(buffered)  # type: ignore[union-attr]

    def _resume(self, r: WorkerRank, *, join: bool) -> None:
        """Replay what was published after the last applied seq, checking first that the
        publisher is still the process that seq came from (see the module rules)."""
        if r.last >= 0 and r.last_ts is not None:
            self._start_replay(r, r.last, None, join=join, verify=True)
        else:
            self._start_replay(r, r.last + 1 if r.last >= 0 else 0, None, join=join)

    def _start_replay(
        self, r: WorkerRank, start: int, target: int | None, *, join: bool, verify: bool = False
    ) -> None:
        r.replay = Replay(start, target, join, verify)
        r.fast = False
        r.stats.replays += 1
        if r.stats.connected:
            self._send_replay(r)

    def _on_replay_reply(
        self, r: WorkerRank, rp: Replay, s: int, payload: bytes, topic: bytes
    ) -> None:
        if rp.verify and rp.lo is None:
            rp.lo = rp.hi = s
            if s == r.last:
                try:
                    ts: float | None = decode_payload(payload, seq=s, topic=topic).ts
                except Exception:  # WireError, or a decoder bug: not the batch that was applied
                    ts = None
                if ts == r.last_ts:
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
            self._malformed(r, exc)
            return
        if r.last == UNANCHORED:
            r.last = s - 1  # joining: take what the publisher still buffers
        elif s > r.last + 1:
            if not rp.failed:
                rp.failed = True
                self._drop(r, f"replay is missing {r.last + 1}..{s - 1}")
            r.last = s - 1
        r.last = s
        self._apply(r, batch)
        st = r.stats
        st.replayed += 1
        st.last_message_at = now = self._clock()
        st.lag_s = now - batch.ts

    def _abort_replay(self, r: WorkerRank) -> None:
        if r.replay is not None and r.replay.join:
            r.stats.replay_done = True
        r.replay = None
        self._replaying.discard(r)
        self._close_watch(r.dealer)
        r.dealer = None
        r.fast = r.stats.trusted

    def _finish_replay(self, r: WorkerRank, error: str | None) -> None:
        rp = r.replay
        if rp is None:
            return
        self._abort_replay(r)
        target = rp.target
        if error is None and target is not None and r.last < target - 1:
            error = f"replay ended at {r.last}, needed up to {target - 1}"
        if error is not None and not rp.failed and (r.last != UNANCHORED or not rp.join):
            self._drop(r, error)
        elif error is not None and not rp.failed:
            r.stats.replay_failures += 1  # joining with nothing to drop
            _log.warning("worker %s rank %d: %s", r.worker_id, r.rank, error)
        if target is not None and r.last < target - 1:
            r.last = target - 1
        if r.last == UNANCHORED and error is None:
            r.last = -1  # the publisher has sent nothing yet: its stream starts at 0
        covered = None if rp.lo is None or rp.hi is None else (rp.lo, rp.hi)
        self._replay_buffered(r, rp.buffer, covered)

    def _send_replay(self, r: WorkerRank) -> None:
        rp = r.replay
        assert rp is not None and r.replay_ep is not None
        rp.sent = True
        now = time.monotonic()
        rp.deadline = now + self._replay_timeout
        rp.hard_deadline = now + 10 * self._replay_timeout
        self._replaying.add(r)
        try:
            dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
            r.dealer = Watch(dealer, self._drain_replay, r)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            dealer.connect(r.replay_ep)
            asyncio.get_running_loop().add_reader(r.dealer.fd, self._on_fd, r.dealer)
            dealer.send_multipart(encode_replay_request(rp.start), _NOBLOCK)
        except (zmq.ZMQError, ValueError, OverflowError) as exc:
            self._finish_replay(r, f"replay request failed: {exc}")
            return
        self._on_fd(r.dealer)

    def _drain_replay(self, r: WorkerRank) -> bool:
        rp = r.replay
        if rp is None or r.dealer is None:
            return False
        recv = r.dealer.sock.recv_multipart
        n = 0
        while n < _DRAIN_CAP:
            try:
                frames = recv(_NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                reply = decode_replay_reply(frames)
            except Exception as exc:
                self._malformed(r, exc)
                continue
            if reply.is_end:  # not an event batch: freshness stays as it was
                if rp.verify and rp.lo is None:
                    self._new_process(r, rp, f"replay holds nothing from applied seq {r.last} on")
                    return False
                self._finish_replay(r, None)
                return False
            try:
                self._on_replay_reply(r, rp, reply.seq, reply.payload, reply.topic or b"")
            except Exception as exc:
                self._log_limited(r, logging.WARNING, "replay reply %d failed: %r", reply.seq, exc)
                r.stats.apply_errors += 1
            if r.replay is not rp:
                return False
        if n:
            rp.deadline = time.monotonic() + self._replay_timeout
            r.stats.last_message_at = self._clock()
        return n == _DRAIN_CAP

    def _check_deadlines(self) -> float | None:
        now = time.monotonic()
        nearest: float | None = None
        for r in list(self._replaying):
            rp = r.replay
            if rp is None:
                continue
            due = min(rp.deadline, rp.hard_deadline)
            if now >= due:
                self._finish_replay(r, "replay timed out")
            elif nearest is None or due - now < nearest:
                nearest = due - now
        return nearest
