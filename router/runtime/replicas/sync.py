"""Replica sync (docs/architecture.md §9): this replica's placements out to its peers, theirs in.

:class:`ReplicaSync` is the placer's :class:`router.placement.ports.PlacementListener`: each
local ticket's commit, first token and end becomes an event, batched per turn of the event loop
into one :class:`router.runtime.replicas.wire.SyncMessage` sent on a ZMQ PUB socket
(``replicas.sync_bind``) without blocking: the PUB drops what a slow or absent peer cannot take
(its SNDHWM), and a send that fails is counted, never waited for.

One task receives: a SUB socket connected to every peer (``replicas.peers``, the peers
discovery finds, the sibling processes of ``--processes``), drained a bounded number of messages
at a time, each decoded once and checked (size, shape, block size, sequence), then applied to
the placer's :class:`router.placement.remote.RemoteTickets` — the one writer of remote state, on
the loop that places. Per publisher (``origin``, random per process start) the messages carry
consecutive sequence numbers: a gap is counted, never replayed (the remote tickets whose end
it may have held expire by their TTL: ``RemoteTickets.gap``); an older or repeated one is
dropped. The same task sends a heartbeat when nothing
else was sent for ``heartbeat_s``, and ends the tickets of a peer silent for ``peer_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from indexer.subscriber.sockets import DRAIN_CAP, NOBLOCK, receive
from router.fleet.peers import RouterPods
from router.observe.replicas import ReplicaStats
from router.placement import Ended, FirstToken, Placer, RemoteEvent, Ticket, placed_event
from router.runtime.replicas.errors import SyncBindError
from router.runtime.replicas.peers import follow_peers, sync_port
from router.runtime.replicas.wire import FLUSH_EVENTS, VERSION, SyncMessage, decode, encode
from router.settings import ReplicaSettings

__all__ = ["SYNC_DROP_REASONS", "ReplicaSync"]

log = logging.getLogger("kvrouter.replicas")

#: messages dropped by the receiver or the sender, by reason (the events a message holds are
#: checked by RemoteTickets, which counts its own: router.placement.remote.DROP_REASONS)
SYNC_DROP_REASONS = (
    "malformed", "version", "block_size", "stale", "too_many_peers", "send_failed", "cut_off"
)  # fmt: skip
#: a flood of origins (a hostile or broken peer) cannot grow the peer table without bound
MAX_PEERS = 1024
#: messages queued per peer on each side before ZMQ drops (PUB) or stops reading (SUB)
HWM = 10_000


class ReplicaSync:
    """See the module docstring. ``start`` opens the sockets and the task; ``aclose`` ends
    them. ``process`` is this process's index under ``server.processes`` (a metric label)."""

    def __init__(
        self,
        settings: ReplicaSettings,
        placer: Placer,
        *,
        block_size: int,
        process: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.placer = placer
        self.block_size = block_size
        self.process = process
        self.clock = clock
        self.origin = secrets.token_hex(8)
        self.endpoint: str | None = None  # where the PUB is bound (the real port of :0 / :*)
        self.seq = 0
        self.sent = self.received = self.gaps = 0
        self.dropped = dict.fromkeys(SYNC_DROP_REASONS, 0)
        self._peers: dict[str, list[float]] = {}  # origin -> [last seq, last heard]
        self._max_hashes = settings.max_hashes
        self._pending: list[RemoteEvent] = []
        self._pending_hashes = 0
        self._flush_at: asyncio.Handle | None = None
        self._last_sent = 0.0
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: zmq.Socket[bytes] | None = None
        #: the SUB's connection events: a peer whose frame broke max_message_bytes is cut off
        #: by libzmq, which never dials it again (a protocol error): we do
        self._mon: zmq.Socket[bytes] | None = None
        self._connected: set[str] = set()
        self._static = list(settings.peers)
        self._task: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None
        # peers from the router's pods (a missing `k8s` extra fails the start here)
        self._pods = RouterPods(settings.discovery) if settings.discovery.enabled else None
        self._wake: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ the listener

    def committed(self, ticket: Ticket) -> None:
        ev = placed_event(ticket, self._max_hashes)
        self._queue(ev, len(ev.hashes))

    def first_token(self, ticket: Ticket) -> None:
        self._queue(FirstToken(ticket.id), 0)

    def ended(self, ticket: Ticket) -> None:
        self._queue(Ended(ticket.id), 0)

    def _queue(self, ev: RemoteEvent, hashes: int) -> None:
        if self._pub is None:
            return
        self._pending.append(ev)
        self._pending_hashes += hashes
        if len(self._pending) >= FLUSH_EVENTS or self._pending_hashes >= self._max_hashes:
            self.flush()
        elif self._flush_at is None and self._loop is not None:
            # the rest of this turn's placements go in the same message
            self._flush_at = self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send what is pending now (also a heartbeat when nothing is)."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        pub = self._pub
        if pub is None:
            return
        events, self._pending, self._pending_hashes = self._pending, [], 0
        msg = SyncMessage(VERSION, self.origin, self.seq, self.block_size, events)
        self.seq += 1  # a message that fails to go is a gap for the peers, as it should be
        try:
            pub.send(encode(msg), NOBLOCK)
        except zmq.ZMQError:  # (a PUB drops at its HWM rather than fail; anything else: here)
            self.dropped["send_failed"] += 1
        else:
            self.sent += 1
        self._last_sent = self.clock()

    # ------------------------------------------------------------ receiving

    def on_message(self, frames: list[bytes], now: float | None = None) -> None:
        """Check and apply one received message (the task's; tests call it directly)."""
        if len(frames) != 1:
            self.dropped["malformed"] += 1
            return
        try:
            m = decode(frames[0])
        except msgspec.DecodeError:  # (a ValidationError is one)
            self.dropped["malformed"] += 1
            return
        if m.origin == self.origin:  # our own, through a peer list or Service that includes us
            return
        if m.version != VERSION:
            self.dropped["version"] += 1
            return
        if m.block_size != self.block_size:  # its hashes would never meet ours
            self.dropped["block_size"] += 1
            return
        now = self.clock() if now is None else now
        peer = self._peers.get(m.origin)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self.dropped["too_many_peers"] += 1
                return
            self._peers[m.origin] = [m.seq, now]
            log.info("replica sync: peer %s joined (seq %d)", m.origin, m.seq)
            self._relane()
        else:
            last = int(peer[0])
            if m.seq <= last:
                self.dropped["stale"] += 1
                return
            if m.seq > last + 1:  # lost: an end among them, maybe (before this one's events)
                self.gaps += m.seq - last - 1
                self.placer.remote.gap(m.origin)
            peer[0], peer[1] = m.seq, now
        self.received += 1
        if m.events:
            self.placer.remote.apply(m.origin, m.events)

    def check_peers(self, now: float) -> None:
        """End the tickets of peers silent for ``peer_timeout_s`` (gone, or cut off)."""
        limit = now - self.settings.peer_timeout_s
        for origin in [o for o, (_, heard) in self._peers.items() if heard < limit]:
            del self._peers[origin]
            n = self.placer.remote.drop_origin(origin)
            log.info("replica sync: peer %s silent, %d of its tickets ended", origin, n)
            self._relane()

    def _relane(self) -> None:
        """This replica's lane: its place among the sorted origins it hears, its own included.
        Replicas that hear each other sort the same origins, so each takes a different lane
        (:func:`router.placement.scoring.rank`)."""
        origins = sorted([self.origin, *self._peers])
        self.placer.lane = (origins.index(self.origin), len(origins))

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        if s.sync_bind is not None:
            pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB, socket_class=zmq.Socket)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, HWM)
            try:
                pub.bind(s.sync_bind)  # (tcp://host:0 binds a free port: see self.endpoint)
            except zmq.ZMQError as e:
                pub.close(linger=0)
                self._ctx.destroy(linger=0)
                raise SyncBindError(f"replicas.sync_bind {s.sync_bind}: {e}") from e
            self._pub = pub
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB, socket_class=zmq.Socket)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, HWM)
        sub.setsockopt(zmq.MAXMSGSIZE, s.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub = sub
        self._mon = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.set_peers(())
        self._fd: int = sub.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._loop.add_reader(self._fd, self._wakeup)
        self._task = asyncio.create_task(self._run(), name="replica-sync")
        if self._pods is not None:
            assert s.sync_bind is not None  # (the settings require it with discovery)
            follow = follow_peers(self._pods, sync_port(s.sync_bind), self.set_peers)
            self._follow = asyncio.create_task(follow, name="replica-peers")
        log.info(
            "replica sync: origin %s, publishing on %s, peers %s",
            self.origin,
            self.endpoint or "(nothing: no replicas.sync_bind)",
            sorted(self._connected) or "none yet",
        )

    def set_peers(self, discovered: Iterable[str]) -> None:
        """Subscribe to the static peers and ``discovered`` (peer discovery's latest list):
        connect to the new ones, disconnect from the gone ones. Never blocks (ZMQ connects in
        the background and retries a peer that is down)."""
        sub = self._sub
        if sub is None:
            return
        want = {*self._static, *discovered}
        if self.endpoint is not None:
            want.discard(self.endpoint)
        for ep in sorted(want - self._connected):
            try:
                sub.connect(ep)
            except zmq.ZMQError as e:
                log.warning("replica sync: cannot connect to peer %s: %s", ep, e)
                continue
            self._connected.add(ep)
        for ep in sorted(self._connected - want):
            try:
                sub.disconnect(ep)
            except zmq.ZMQError:
                pass
            self._connected.discard(ep)

    def _wakeup(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def _readable(self) -> bool:
        assert self._sub is not None
        events: int = self._sub.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
        return bool(events & zmq.POLLIN)  # (resets the FD's edge)

    async def _run(self) -> None:
        sub = self._sub
        assert sub is not None and self._loop is not None
        beat = self.settings.heartbeat_s
        while True:
            self._redial_lost()
            batch = receive(sub)
            now = self.clock()
            for frames in batch:
                self.on_message(frames, now)
            if now - self._last_sent >= beat:
                self.flush()  # nothing sent for a while: a heartbeat says we are here
            self.check_peers(now)
            if len(batch) == DRAIN_CAP:
                await asyncio.sleep(0)  # more waiting: let the placing handlers run first
                continue
            self._wake = self._loop.create_future()
            if self._readable():
                continue
            timer = self._loop.call_later(beat, self._wakeup)
            try:
                await self._wake
            finally:
                timer.cancel()
                self._wake = None

    def _redial_lost(self) -> None:
        """Connect again to each peer whose connection dropped (its frame over
        ``max_message_bytes``, or it went away): counted as ``cut_off``."""
        mon, sub = self._mon, self._sub
        if mon is None or sub is None:
            return
        for frames in receive(mon):
            try:
                ep = parse_monitor_message(frames)["endpoint"].decode()
            except (KeyError, ValueError, AttributeError, struct.error):
                continue
            if ep not in self._connected:
                continue
            self.dropped["cut_off"] += 1
            log.warning("replica sync: connection to peer %s lost: dialling it again", ep)
            with contextlib.suppress(zmq.ZMQError):  # (the session may be gone already)
                sub.disconnect(ep)
            with contextlib.suppress(zmq.ZMQError):
                sub.connect(ep)

    async def aclose(self) -> None:
        for task in (self._task, self._follow):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._follow = None
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if self._sub is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
        if self._sub is not None and self._mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        for sock in (self._mon, self._sub, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._pub = self._mon = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def stats(self) -> ReplicaStats:
        remote = self.placer.remote
        return ReplicaStats(
            origin=self.origin,
            process=str(self.process),
            sent=self.sent,
            received=self.received,
            gaps=self.gaps,
            peers=len(self._peers),
            lane=self.placer.lane[0],
            remote_tickets=len(remote),
            dropped={**self.dropped, **remote.dropped},
            ended=dict(remote.ended),
        )
