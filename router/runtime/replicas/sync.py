"""Replica sync (docs/architecture.md §9): this replica's placements out to its peers, theirs in.

:class:`ReplicaSync` is the placer's :class:`router.placement.ports.PlacementListener`: each
local ticket's commit, first token and end becomes an event, batched per turn of the event loop
into one :class:`router.runtime.replicas.wire.SyncMessage` sent on a ZMQ PUB socket
(``replicas.sync_bind``) without blocking: the PUB drops what a slow or absent peer cannot take
(its SNDHWM), and a send that fails is counted, never waited for.

One task receives: a SUB socket connected to every peer (``replicas.peers``, the peers
discovery finds, the sibling processes of ``--processes``: :mod:`.links`), drained under a
budget of time and hashes per turn of the loop (:mod:`.budget`), each message decoded once and
checked (size, shape, block size, hashes, sequence), then applied to the placer's
:class:`router.placement.remote.RemoteTickets` — the one writer of remote state, on the loop
that places, within its byte budgets. Per publisher (``origin``, random per process start) the
messages carry consecutive sequence numbers, judged by :mod:`.origins`: a gap is counted, never
replayed (the remote tickets whose end it may have held expire by their TTL:
``RemoteTickets.gap``); a repeated one is dropped; one far off is a reset. The same task sends a
heartbeat when nothing else was sent for ``heartbeat_s``, and ends the tickets of a peer silent
for ``peer_timeout_s``. With a peer key every socket runs CURVE (:mod:`.curve`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import zmq

from indexer.subscriber.sockets import DRAIN_CAP, NOBLOCK
from router.fleet.peers import RouterPods
from router.observe.replicas import ReplicaStats
from router.placement import Ended, FirstToken, Placed, Placer, RemoteEvent, Ticket, placed_event
from router.runtime.replicas.budget import Drain, queue_hwm
from router.runtime.replicas.curve import Curve
from router.runtime.replicas.errors import SyncBindError
from router.runtime.replicas.links import WARN_EVERY_S, Links
from router.runtime.replicas.origins import Origins, Seq
from router.runtime.replicas.peerkey import PeerKey
from router.runtime.replicas.peers import follow_peers, sync_port
from router.runtime.replicas.wire import FLUSH_EVENTS, VERSION, SyncMessage, decode, encode
from router.settings import ReplicaSettings

__all__ = ["SYNC_DROP_REASONS", "ReplicaSync"]

log = logging.getLogger("kvrouter.replicas")

#: messages dropped by the receiver or the sender, by reason (the events a message holds are
#: checked by RemoteTickets, which counts its own: router.placement.remote.DROP_REASONS);
#: ``spoofed``: under an origin bound to another address (origins.py); ``oversized``: more hashes
#: than a publisher sends (2 x max_hashes); ``error``: applying it raised (a defect here, never
#: the peer's to cause: logged, and the task goes on); ``cut_off``: connections lost (links.py)
SYNC_DROP_REASONS = (
    "malformed", "version", "block_size", "stale", "spoofed", "oversized", "error",
    "send_failed", "cut_off",
)  # fmt: skip


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
        key: PeerKey | None = None,
    ) -> None:
        self.settings = settings
        self.placer = placer
        self.block_size = block_size
        self.process = process
        self.clock = clock
        self.origin = secrets.token_hex(8)
        self.endpoint: str | None = None  # where the PUB is bound (the real port of :0 / :*)
        self.seq = 0
        self.sent = self.received = 0
        self.dropped = dict.fromkeys(SYNC_DROP_REASONS, 0)
        self.origins = Origins()
        self._max_hashes = settings.max_hashes
        # ``key``: the replicas' peer key, read once at start by the runtime (None: none)
        self.curve = Curve(key) if key is not None else None
        self._drain = Drain(settings.drain_budget_ms / 1000, settings.drain_max_hashes)
        self._next_warn: dict[str, float] = {}  # per kind of warning: when to warn again
        self._pending: list[RemoteEvent] = []
        self._pending_hashes = 0
        self._flush_at: asyncio.Handle | None = None
        self._last_sent = 0.0
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: zmq.Socket[bytes] | None = None
        self.links: Links | None = None
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

    def on_message(
        self, frames: Sequence[bytes | memoryview], now: float | None = None, addr: str = ""
    ) -> int:
        """Check and apply one received message from ``addr`` (its ``Peer-Address``; "": not
        known), the task's; tests call it directly. Returns the hashes it held (what the
        drain's budget counts), 0 for one dropped."""
        if len(frames) != 1:
            self.dropped["malformed"] += 1
            return 0
        try:
            m = decode(frames[0])
        except msgspec.DecodeError:  # (a ValidationError is one; wire.decode maps the rest)
            self.dropped["malformed"] += 1
            return 0
        if m.origin == self.origin:  # our own, through a peer list or Service that includes us
            return 0
        if m.version != VERSION:
            self.dropped["version"] += 1
            return 0
        if m.block_size != self.block_size:  # its hashes would never meet ours
            self.dropped["block_size"] += 1
            return 0
        hashes = sum(len(ev.hashes) for ev in m.events if type(ev) is Placed)
        if hashes > 2 * self._max_hashes:  # more than a publisher sends: before any of it
            self.dropped["oversized"] += 1
            return 0
        now = self.clock() if now is None else now
        remote = self.placer.remote
        verdict, evicted = self.origins.admit(m.origin, m.seq, now, addr)
        if verdict is Seq.STALE or verdict is Seq.SPOOFED:
            self.dropped[verdict.value] += 1
            return 0
        if verdict is Seq.NEW:
            if evicted is None:
                log.info("replica sync: peer %s joined (seq %d)", m.origin, m.seq)
            else:
                n = remote.drop_origin(evicted)
                self._warn(
                    "evicted",
                    "replica sync: %d peers heard: the one silent longest, %s, makes room for "
                    "%s (%d of its tickets ended)", len(self.origins), evicted, m.origin, n,
                )  # fmt: skip
            self._relane()
        elif verdict is Seq.RESET:
            self._warn(
                "reset",
                "replica sync: peer %s's seq jumped to %d: taken as a reset (a replayed or "
                "spoofed origin?)", m.origin, m.seq,
            )  # fmt: skip
            remote.gap(m.origin)
        elif verdict is Seq.GAP:  # lost: an end among them, maybe (before this one's events)
            remote.gap(m.origin)
        self.received += 1
        if m.events:
            remote.apply(m.origin, m.events)
        return hashes

    def _warn(self, kind: str, msg: str, *args: object, exc_info: bool = False) -> None:
        """A warning a flood could repeat per message: at most once per ``WARN_EVERY_S`` per
        kind (at debug between; the counters have every one)."""
        now = time.monotonic()
        warn = now >= self._next_warn.get(kind, 0.0)
        if warn:
            self._next_warn[kind] = now + WARN_EVERY_S
        log.log(logging.WARNING if warn else logging.DEBUG, msg, *args, exc_info=exc_info)

    def check_peers(self, now: float) -> None:
        """End the tickets of peers silent for ``peer_timeout_s`` (gone, or cut off)."""
        for origin in self.origins.silent(now - self.settings.peer_timeout_s):
            n = self.placer.remote.drop_origin(origin)
            log.info("replica sync: peer %s silent, %d of its tickets ended", origin, n)
            self._relane()

    def _relane(self) -> None:
        """This replica's lane: its place among the sorted origins it hears, its own included.
        Replicas that hear each other sort the same origins, so each takes a different lane
        (:func:`router.placement.scoring.rank`)."""
        origins = sorted([self.origin, *self.origins])
        self.placer.lane = (origins.index(self.origin), len(origins))

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        if self.curve is not None:
            self.curve.start(self._ctx)
        if s.sync_bind is not None:
            pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB, socket_class=zmq.Socket)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, queue_hwm(s.max_queue_mib, s.sent_message_bytes))
            if self.curve is not None:
                self.curve.server(pub)
            try:
                pub.bind(s.sync_bind)  # (tcp://host:0 binds a free port: see self.endpoint)
            except zmq.ZMQError as e:
                pub.close(linger=0)
                if self.curve is not None:
                    self.curve.stop()
                self._ctx.destroy(linger=0)
                raise SyncBindError(f"replicas.sync_bind {s.sync_bind}: {e}") from e
            self._pub = pub
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB, socket_class=zmq.Socket)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, queue_hwm(s.max_queue_mib, s.max_message_bytes))
        sub.setsockopt(zmq.MAXMSGSIZE, s.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if self.curve is not None:
            self.curve.client(sub)
        self._sub = sub
        self.links = Links(sub, self._pub, s.peers, self.endpoint)
        self.set_peers(())
        self._fd: int = sub.getsockopt(zmq.FD)  # type: ignore[assignment]
        self._loop.add_reader(self._fd, self._wakeup)
        self._task = asyncio.create_task(self._run(), name="replica-sync")
        self._task.add_done_callback(_ended)
        if self._pods is not None:
            assert s.sync_bind is not None  # (the settings require it with discovery)
            follow = follow_peers(self._pods, sync_port(s.sync_bind), self.set_peers)
            self._follow = asyncio.create_task(follow, name="replica-peers")
        log.info(
            "replica sync: origin %s, publishing on %s, peers %s, %s",
            self.origin,
            self.endpoint or "(nothing: no replicas.sync_bind)",
            sorted(self.links.connected) or "none yet",
            "CURVE (replicas.peer_key_file)" if self.curve else "no authentication",
        )

    def set_peers(self, discovered: Iterable[str]) -> None:
        """Subscribe to the static peers and ``discovered`` (:meth:`Links.set_peers`)."""
        if self.links is not None:
            self.links.set_peers(discovered)

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
        assert sub is not None and self._loop is not None and self.links is not None
        beat = self.settings.heartbeat_s
        drain = self._drain
        while True:
            self.links.poll()
            more = self._drain_turn(sub, drain)
            now = self.clock()
            if now - self._last_sent >= beat:
                self.flush()  # nothing sent for a while: a heartbeat says we are here
            self.check_peers(now)
            if more:
                await asyncio.sleep(0)  # the budget is spent: let the placing handlers run
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

    def _drain_turn(self, sub: zmq.Socket[bytes], drain: Drain) -> bool:
        """Apply waiting messages within one turn's budget; whether more may be waiting."""
        drain.start()
        recv = sub.recv_multipart
        now = self.clock()
        for _ in range(DRAIN_CAP):
            try:
                parts = recv(NOBLOCK, copy=False)  # (Frames: their connection's address)
            except zmq.Again:
                return False
            try:
                addr = parts[0].get("Peer-Address")
            except zmq.ZMQError:  # (a transport without one)
                addr = ""
            try:
                hashes = self.on_message([p.buffer for p in parts], now, str(addr))
            except Exception:  # a defect must not end sync: count it, say it, read on
                hashes = 0
                self.dropped["error"] += 1
                self._warn("error", "replica sync: applying a peer's message failed (dropped)",
                           exc_info=True)  # fmt: skip
            if not drain.spend(hashes):
                return True
        return True

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
        if self.links is not None:
            self.links.close()
            self.links = None
        for sock in (self._sub, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._pub = None
        if self.curve is not None:
            self.curve.stop()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    @property
    def gaps(self) -> int:
        return self.origins.gaps

    def stats(self) -> ReplicaStats:
        remote, links = self.placer.remote, self.links
        return ReplicaStats(
            origin=self.origin,
            process=str(self.process),
            sent=self.sent,
            received=self.received,
            gaps=self.origins.gaps,
            resets=self.origins.resets,
            peers=len(self.origins),
            peers_evicted=self.origins.evicted,
            lane=self.placer.lane[0],
            remote_tickets=len(remote),
            remote_state_bytes=remote.bytes,
            dropped={**self.dropped, **remote.dropped, "cut_off": links.cut_off if links else 0},
            ended=dict(remote.ended),
            handshake_failed=dict(links.handshake_failed) if links else {},
        )


def _ended(task: asyncio.Task[None]) -> None:
    """The sync task ends only when cancelled; anything else is said, never swallowed."""
    if not task.cancelled() and task.exception() is not None:
        log.error("replica sync stopped: peers are no longer heard", exc_info=task.exception())
