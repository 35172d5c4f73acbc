"""Replica sync's peer table: each publisher (``origin``) heard, its last sequence number and when
it was last heard, and what a new message's ``seq`` means (:meth:`Origins.admit`).

A peer can send under another's origin — a hostile key holder, or a buggy one (a replayed
stream, a corrupted seq). What such a message may do is bounded at the cause:

- an origin is bound to the address it was first heard from (libzmq's ``Peer-Address`` of the
  message: a TCP peer's IP, an ``ipc://`` peer's process), and a message under it from another
  address is dropped (``spoofed``): a peer in another pod cannot speak for this one at all. (A
  SUB does not tell its connections apart otherwise; peers that share an address — several on
  one host over TCP — are told apart by the rules below only);
- a seq far from the origin's last (more than ``SEQ_WINDOW`` either way) is a **reset**, not a
  verdict on what follows: it is applied, counted, and the origin's later messages are judged
  from it; so one message with a huge seq no longer silences the real origin (every message
  after it was "stale", for good), nor counts 2^62 lost messages. A reset is a gap too: the
  origin's earlier tickets become subject to their TTL (their ends may be lost);
- a seq at most ``SEQ_WINDOW`` behind is a duplicate or a late copy (the same peer heard through
  two addresses): dropped, as ``stale``;
- the table is bounded (``MAX_PEERS``), and when full the origin silent longest makes room
  (counted: ``peers_evicted``), so a flood of made-up origins cannot lock newcomers out; a real
  peer heartbeats every ``heartbeat_s``, so it is evicted only by ``MAX_PEERS`` other origins
  within one heartbeat (it then returns as a new peer).

The table is kept in order of last hearing (a heard origin moves to the back), so the longest
silent is the first: eviction and the silence check cost nothing per origin that is alive.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

__all__ = ["MAX_PEERS", "SEQ_WINDOW", "Origins", "Seq"]

#: origins kept at once (a flood of origins cannot grow the table without bound)
MAX_PEERS = 1024
#: how far a seq may be from an origin's last and still be read as in order (a gap ahead, a
#: duplicate behind); further is a reset. Wider than any lag between two paths to one peer
#: (each holds at most its queue, replicas.max_queue_mib)
SEQ_WINDOW = 1 << 16


class Seq(enum.Enum):
    """What a message's seq is, from its origin's last."""

    NEW = "new"  #: the first from this origin
    NEXT = "next"  #: the next one
    GAP = "gap"  #: ahead: the ones between were lost
    STALE = "stale"  #: at or a little behind the last: a duplicate, dropped
    SPOOFED = "spoofed"  #: from another address than the origin's: dropped
    RESET = "reset"  #: far from the last either way: applied, counted, judged from now on


class Origins:
    """See the module docstring."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self.max_peers = max_peers
        #: origin -> (last seq, last heard, the address it is bound to)
        self._peers: dict[str, tuple[int, float, str]] = {}
        self.gaps = self.resets = self.evicted = 0

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[str]:
        return iter(self._peers)

    def admit(self, origin: str, seq: int, now: float, addr: str = "") -> tuple[Seq, str | None]:
        """Judge ``seq`` from ``origin`` heard at ``now`` from ``addr`` ("": not known), and
        record it unless it is stale or spoofed. Returns the verdict and the origin evicted to
        make room for a new one (or None)."""
        peers = self._peers
        last = peers.get(origin)
        if last is not None and addr != last[2] and addr and last[2]:
            return Seq.SPOOFED, None  # (not heard: the real origin's silence still counts)
        if last is not None:
            del peers[origin]  # (inserted again below: the order is of last hearing)
        if last is None:
            evicted = None
            if len(peers) >= self.max_peers:
                evicted = next(iter(peers))  # the longest silent
                del peers[evicted]
                self.evicted += 1
            peers[origin] = (seq, now, addr)
            return Seq.NEW, evicted
        prev = last[0]
        d = seq - prev
        if -SEQ_WINDOW <= d <= 0:
            peers[origin] = (prev, now, last[2])  # (a copy: the origin is alive all the same)
            return Seq.STALE, None
        peers[origin] = (seq, now, last[2] or addr)
        if d == 1:
            return Seq.NEXT, None
        if 0 < d <= SEQ_WINDOW:
            self.gaps += d - 1
            return Seq.GAP, None
        self.resets += 1
        return Seq.RESET, None

    def silent(self, before: float) -> list[str]:
        """Remove and return the origins last heard before ``before``."""
        out: list[str] = []
        for origin, (_, heard, _) in self._peers.items():
            if heard >= before:
                break
            out.append(origin)
        for origin in out:
            del self._peers[origin]
        return out
