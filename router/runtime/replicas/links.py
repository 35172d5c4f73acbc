"""Replica sync's connections: which peers the SUB dials, and what the sockets' monitors say.

:class:`Links` owns the SUB's set of connected endpoints (``set_peers``: the static peers and
the ones discovery finds) and two monitors, read by the sync task each turn (``poll``):

- the SUB's: a peer whose frame broke ``max_message_bytes`` is cut off by libzmq, which never
  dials it again (a protocol error), nor after a refused handshake: each lost connection is
  dialled again here, counted ``cut_off`` unless a failed handshake explains it;
- both sockets' failed handshakes (a peer with another peer key, or none, under CURVE:
  :mod:`router.runtime.replicas.curve`), counted by reason and logged at warning once per
  endpoint and reason per ``WARN_EVERY_S`` (the PUB's monitor names only its bound endpoint),
  at debug between: a wrong key retries for as long as it is wrong and must not fill the log.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from collections.abc import Iterable

import zmq
from zmq.utils.monitor import parse_monitor_message

from indexer.subscriber.sockets import receive
from router.runtime.replicas.curve import HANDSHAKE_EVENTS, HANDSHAKE_REASONS, handshake_failure

__all__ = ["Links"]

log = logging.getLogger("kvrouter.replicas")

#: a failing handshake is warned about once per endpoint and reason this often (debug between)
WARN_EVERY_S = 60.0
_SUB_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_EVENTS
_PUB_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_EVENTS


class Links:
    """See the module docstring. ``pub`` may be None (a replica that only listens)."""

    def __init__(
        self,
        sub: zmq.Socket[bytes],
        pub: zmq.Socket[bytes] | None,
        static: Iterable[str],
        own: str | None,
    ) -> None:
        self._sub = sub
        self._static = list(static)
        self._own = own  # this replica's PUB endpoint: never dialled (a peer list may hold it)
        self.connected: set[str] = set()
        self.cut_off = 0
        self.handshake_failed = dict.fromkeys(HANDSHAKE_REASONS, 0)
        self.failing: set[str] = set()  #: peers whose last handshake failed
        self._next_warn: dict[str, float] = {}  # per endpoint and reason: when to warn again
        self._sub_mon: zmq.Socket[bytes] = sub.get_monitor_socket(_SUB_EVENTS)
        self._pub_mon = pub.get_monitor_socket(_PUB_EVENTS) if pub is not None else None
        self._pub = pub

    def set_peers(self, discovered: Iterable[str]) -> None:
        """Subscribe to the static peers and ``discovered`` (peer discovery's latest list):
        connect to the new ones, disconnect from the gone ones. Never blocks (ZMQ connects in
        the background and retries a peer that is down)."""
        sub = self._sub
        want = {*self._static, *discovered}
        want.discard(self._own or "")
        for ep in sorted(want - self.connected):
            try:
                sub.connect(ep)
            except zmq.ZMQError as e:
                log.warning("replica sync: cannot connect to peer %s: %s", ep, e)
                continue
            self.connected.add(ep)
        for ep in sorted(self.connected - want):
            with contextlib.suppress(zmq.ZMQError):
                sub.disconnect(ep)
            self.connected.discard(ep)
            self.failing.discard(ep)
            for k in [k for k in self._next_warn if k.startswith(f"peer {ep}:")]:
                del self._next_warn[k]

    def poll(self) -> None:
        """Read both monitors: count, log, and dial again what was lost."""
        if self._pub_mon is not None:
            for frames in receive(self._pub_mon):
                ev = _event(frames)
                if ev is not None:
                    self._handshake(ev[2], ev[0], ev[1], "subscriber")
        for frames in receive(self._sub_mon):
            ev = _event(frames)
            if ev is None or ev[2] not in self.connected:
                continue
            event, value, ep = ev
            if event == zmq.EVENT_DISCONNECTED:
                if ep not in self.failing:  # (after a failed handshake: counted as that)
                    self.cut_off += 1
                    log.warning("replica sync: connection to peer %s lost: dialling it again", ep)
                self._redial(ep)
            else:
                self._handshake(ep, event, value, "peer")

    def _handshake(self, where: str, event: int, value: int, who: str) -> None:
        reason = handshake_failure(event, value)
        if reason is None:  # succeeded
            if who == "peer" and where in self.failing:
                self.failing.discard(where)
                log.info("replica sync: handshake with %s %s succeeded", who, where)
            return
        self.handshake_failed[reason] += 1
        if who == "peer":
            self.failing.add(where)
        key = f"{who} {where}:{reason}"
        now = time.monotonic()
        level = logging.WARNING if now >= self._next_warn.get(key, 0.0) else logging.DEBUG
        if level == logging.WARNING:
            self._next_warn[key] = now + WARN_EVERY_S
        log.log(
            level,
            "replica sync: handshake with a %s on %s failed (%s): %s",
            who,
            where,
            reason,
            _ADVICE[reason],
        )

    def _redial(self, ep: str) -> None:
        sub = self._sub
        with contextlib.suppress(zmq.ZMQError):  # (the session may be gone already)
            sub.disconnect(ep)
        with contextlib.suppress(zmq.ZMQError):
            sub.connect(ep)

    def close(self) -> None:
        """Stop and close the monitors (before the sockets they watch are closed)."""
        for sock, mon in ((self._sub, self._sub_mon), (self._pub, self._pub_mon)):
            if sock is not None and mon is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                mon.close(linger=0)
        self._pub_mon = None


_ADVICE = {
    "auth": "its key is not this fleet's peer key (replicas.peer_key_file differs)",
    "crypto": "it holds another peer key than this replica (replicas.peer_key_file differs)",
    "mechanism": "one side has a peer key and the other none (replicas.peer_key_file)",
    "other": "a peer key mismatch or a stranger on the sync port",
}


def _event(frames: list[bytes]) -> tuple[int, int, str] | None:
    try:
        m = parse_monitor_message(frames)
        return int(m["event"]), int(m["value"]), m["endpoint"].decode()
    except (KeyError, ValueError, AttributeError, struct.error, UnicodeDecodeError):
        return None
