"""Replica sync's budgets on its task and its sockets (docs/architecture.md §9, "Budgets"); the
budget of remote state itself is :class:`router.placement.remote.RemoteTickets`'.

- :class:`Drain`: one turn of the sync task applies messages until ``drain_budget_ms`` passed or
  ``drain_max_hashes`` hashes were applied, then yields to the loop (the placing handlers,
  ``/health``) before it reads on. A turn applies at least one message, so it costs at most the
  budget plus one message: ``max_message_bytes`` decoded, at most 2 x ``max_hashes`` hashes
  applied (a publisher never sends more: a message with more is dropped, ``oversized``).
- :func:`queue_hwm`: libzmq bounds each connection's queue in messages (the SUB's RCVHWM, the
  PUB's SNDHWM, per peer); derived from ``max_queue_mib`` and the largest message the socket
  may carry, a queue holds at most ``max_queue_mib`` MiB whatever the messages' size.
"""

from __future__ import annotations

import time

__all__ = ["Drain", "queue_hwm"]


def queue_hwm(queue_mib: float, message_bytes: int) -> int:
    """The high-water mark (in messages) that keeps a queue of messages of up to
    ``message_bytes`` within ``queue_mib`` MiB (at least one message)."""
    return max(1, int(queue_mib * (1 << 20)) // message_bytes)


class Drain:
    """The budget of one turn of the sync task: ``start`` it, ``spend`` each message's hashes;
    ``spend`` says whether the turn may take another message. Wall time, whatever clock the
    sync runs on: the loop's other work waits in real time."""

    __slots__ = ("_hashes", "_until", "budget_s", "max_hashes")

    def __init__(self, budget_s: float, max_hashes: int) -> None:
        self.budget_s = budget_s
        self.max_hashes = max_hashes
        self._until = 0.0
        self._hashes = 0

    def start(self) -> None:
        self._until = time.perf_counter() + self.budget_s
        self._hashes = 0

    def spend(self, hashes: int) -> bool:
        self._hashes += hashes
        return self._hashes < self.max_hashes and time.perf_counter() < self._until
