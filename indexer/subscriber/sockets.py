"""The subscriber's sockets and how the task waits for them: every socket is a plain pyzmq socket
whose ``zmq.FD`` is registered with the asyncio loop (a ``Watch``); a socket that becomes readable
is queued in ``Sockets.ready`` and wakes the task, which drains it with ``receive``: the one drain
loop, bounded per round so one busy socket cannot starve the others. No future per message.

Batching (``batch_window`` > 0): at a live rate every message would be one wake-up of an idle
loop, and the wake-up costs more than the message (``benchmarks/bench_ingest.py --only paced``).
So once SUBs have woken the task three times within a window (the task decides), every SUB's
reader comes off the loop (``hold``) and a timer polls them all once per window (``_poll``),
queueing whatever came meanwhile for one round of the task; the first poll that finds nothing
puts the readers back (``release``). An idle fleet costs nothing, the first message after a quiet
spell is read at once, and a busy one is read at most a window late.

Per worker rank: a SUB on the event endpoint with a monitor (PAIR) that reports its connection;
while a replay runs, a DEALER on the replay endpoint (opened by ``indexer.subscriber.replay``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections.abc import Callable
from typing import Any

import zmq

from indexer.subscriber.records import Watch, WorkerRank, log_limited

__all__ = ["DRAIN_CAP", "NOBLOCK", "Sockets", "monitor_event", "receive"]

#: Messages taken from one socket per round of the task.
DRAIN_CAP = 512
#: A plain int: it skips pyzmq's per-call conversion of the flag enum.
NOBLOCK = int(zmq.NOBLOCK)

_MON_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_MON_HEADER = struct.Struct("=Hi")  # monitor event frame: event id, value


def receive(sock: zmq.Socket[bytes]) -> list[list[bytes]]:
    """Up to ``DRAIN_CAP`` messages waiting on ``sock``, without blocking. A full list means more
    may be waiting: the caller asks to be drained again next round."""
    recv = sock.recv_multipart
    out: list[list[bytes]] = []
    append = out.append
    for _ in range(DRAIN_CAP):
        try:
            append(recv(NOBLOCK))
        except zmq.Again:
            break
    return out


def monitor_event(frames: list[bytes]) -> int | None:
    """The event id of a monitor message (``zmq.EVENT_*``); None for a frame of another shape."""
    if len(frames[0]) != _MON_HEADER.size:
        return None
    event: int = _MON_HEADER.unpack(frames[0])[0]
    return event


class Sockets:
    """Creates, registers and closes the subscriber's sockets; holds the queue of readable ones
    and the future the task sleeps on. Used by the subscriber task only."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        *,
        rcvhwm: int,
        max_message_bytes: int,
        batch_window: float = 0.0,
    ) -> None:
        self._ctx = ctx
        self._rcvhwm = rcvhwm
        # ZMQ_MAXMSGSIZE of publisher-facing sockets: a peer sending more is cut off unbuffered
        self._max_message_bytes = max_message_bytes
        self._mon_ids = itertools.count()
        #: Watches with messages waiting (a dict: ordered, no duplicates).
        self.ready: dict[Watch, None] = {}
        self._wake: asyncio.Future[None] | None = None
        #: Seconds between polls of the SUBs while held (0: a wake-up per readable SUB).
        self.batch_window = batch_window
        #: Every open SUB's watch; ``held``: their readers are off the loop, a timer polls them.
        self._subs: dict[Watch, None] = {}
        self.held = False
        self._poll_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ open

    def open_rank(
        self,
        r: WorkerRank,
        drain_sub: Callable[[WorkerRank], bool],
        drain_mon: Callable[[WorkerRank], bool],
    ) -> None:
        """Subscribe rank ``r`` to its event endpoint and watch the connection. The watches are
        set on ``r`` as soon as their sockets exist, so ``close_rank`` frees them on any error."""
        loop = asyncio.get_running_loop()
        sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB, socket_class=zmq.Socket)
        r.sub = Watch(sub, drain_sub, r)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        addr = f"inproc://kvrouter-subscriber-monitor-{id(self):x}-{next(self._mon_ids)}"
        sub.monitor(addr, _MON_EVENTS)
        mon: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        r.mon = Watch(mon, drain_mon, r)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(addr)
        sub.connect(r.events_ep)
        if r.events_ep.startswith("inproc://"):  # no handshake, so no monitor event, in-process
            r.stats.connected = r.ever_connected = True
        self._subs[r.sub] = None
        for w in (r.sub, r.mon):
            if not (self.held and w is r.sub):  # a held SUB is read at the next poll
                loop.add_reader(w.fd, self.on_fd, w)
            self.on_fd(w)

    def open_dealer(
        self, r: WorkerRank, endpoint: str, drain: Callable[[WorkerRank], bool]
    ) -> Watch:
        """A DEALER connected to ``endpoint`` for rank ``r``, registered with the loop (closed
        again if any step fails)."""
        dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        w = Watch(dealer, drain, r)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            dealer.connect(endpoint)
            asyncio.get_running_loop().add_reader(w.fd, self.on_fd, w)
        except BaseException:
            self.close(w)
            raise
        return w

    def redial(self, r: WorkerRank) -> None:
        """Connect rank ``r``'s SUB again ourselves: libzmq does not reconnect after a protocol
        error, and a message over ZMQ_MAXMSGSIZE is one; a fresh connect retries like its own
        reconnect."""
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
            log_limited(r, logging.WARNING, "reconnect failed: %r", exc)

    # ----------------------------------------------------------------- close

    def close(self, w: Watch | None) -> None:
        if w is None or w.closed:
            return
        w.closed = True
        self.ready.pop(w, None)
        self._subs.pop(w, None)
        try:
            asyncio.get_running_loop().remove_reader(w.fd)
        except RuntimeError:  # no running loop (closing outside one): nothing is registered
            pass
        w.sock.close(linger=0)

    def close_rank(self, r: WorkerRank) -> None:
        """Close rank ``r``'s SUB and monitor (its DEALER belongs to its replay)."""
        if r.sub is not None and not r.sub.closed:
            try:
                r.sub.sock.disable_monitor()
            except zmq.ZMQError:
                pass
        self.close(r.mon)
        self.close(r.sub)

    # ------------------------------------------------------------- readiness

    def on_fd(self, w: Watch) -> None:
        """Queue ``w`` if it holds messages. ZMQ_FD is edge-like: reading ZMQ_EVENTS resets it,
        so the check is made here, whenever the loop reports the fd or a drain stopped early."""
        if self._readable(w):
            self.ready[w] = None
            self.wakeup()

    @staticmethod
    def _readable(w: Watch) -> bool:
        if w.closed:
            return False
        try:
            events: int = w.sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
        except zmq.ZMQError:
            return False
        return bool(events & zmq.POLLIN)

    def is_sub(self, w: Watch) -> bool:
        return w in self._subs

    def hold(self) -> None:
        """Take every SUB's reader off the loop and poll them once per window until a poll finds
        nothing (``release``)."""
        if self.held:
            return
        loop = asyncio.get_running_loop()
        for w in self._subs:
            loop.remove_reader(w.fd)
        self.held = True
        self._poll_timer = loop.call_later(self.batch_window, self._poll)

    def _poll(self) -> None:
        self._poll_timer = None
        found = False
        for w in self._subs:
            if self._readable(w):
                self.ready[w] = None
                found = True
        if not found:  # a quiet window: the next message wakes the task again
            self.release()
            return
        self.wakeup()
        self._poll_timer = asyncio.get_running_loop().call_later(self.batch_window, self._poll)

    def release(self) -> None:
        """Put the SUBs' readers back on the loop (queueing any that holds messages)."""
        if not self.held:
            return
        self.held = False
        if self._poll_timer is not None:
            self._poll_timer.cancel()
            self._poll_timer = None
        loop = asyncio.get_running_loop()
        for w in self._subs:
            loop.add_reader(w.fd, self.on_fd, w)
            self.on_fd(w)

    def wakeup(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Sleep until ``wakeup`` (a readable socket, a command) or ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        wake = self._wake = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, self.wakeup)
        try:
            await wake
        finally:
            self._wake = None
            if timer is not None:
                timer.cancel()
