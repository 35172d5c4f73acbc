"""How many ext_proc streams the picker takes at once, and what the others get
(:class:`StreamGate`), with the gRPC server options that keep gRPC core from turning streams
away before the picker sees them (:func:`server_options`).

Issue 37, 8: 3,000 streams opened at once on one connection lost 9-24 % inside gRPC core: its
queue of calls the application has not taken yet (``grpc.server.max_pending_requests``, 1,000
by default, hard limit 3,000) refused the rest with RESOURCE_EXHAUSTED, which a grpc.aio client
even reports as INTERNAL or CANCELLED when its first write is under way; the picker never saw
them, so nothing logged or counted them. Now every stream reaches the picker, which serves it or
refuses it itself, counted (``kvrouter_epp_streams_refused_total``) and logged:

- one connection carries at most ``epp.max_streams`` streams at once (HTTP/2's
  SETTINGS_MAX_CONCURRENT_STREAMS): its client (Envoy, any gRPC client) queues the rest, so one
  connection's burst is back-pressure, never a refusal;
- past ``epp.max_streams`` open (several connections), a stream is answered 429 once its headers
  come, an ``ImmediateResponse`` that Envoy hands its client (reason ``max_streams``);
- past :data:`BACKLOG` times ``epp.max_streams`` open, a stream is closed RESOURCE_EXHAUSTED
  before a read (reason ``overload``): this bounds what a flood of streams that never speak
  holds. gRPC's own ``maximum_concurrent_rpcs`` would refuse the same streams before the
  picker's handler runs, uncounted: it stays unset;
- gRPC core queues at least as many calls that the picker has not taken yet (soft and hard
  limits alike, :data:`CORE_QUEUE_FLOOR` at the least: a burst arrives faster than one turn of
  the loop takes calls, and a refusal there is unseen); it refuses one itself (RESOURCE_EXHAUSTED,
  which only Envoy's ext_proc statistics count) only when that many wait at once for the loop.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from router.observe.epp import EppMetrics

__all__ = ["BACKLOG", "CORE_QUEUE_FLOOR", "MAX_STREAMS", "OVERLOAD", "StreamGate", "server_options"]

log = logging.getLogger("kvrouter.epp")

#: open streams past which a new one is closed at once, in units of epp.max_streams
BACKLOG = 4
#: gRPC core's queue of calls not yet taken by the picker holds at least this many
CORE_QUEUE_FLOOR = 16384
#: the refusal reasons (the metric's label)
MAX_STREAMS, OVERLOAD = "max_streams", "overload"
#: at most one warning line this often while streams are refused (a flood must not flood the log)
_WARN_EVERY_S = 10.0


def server_options(max_streams: int, max_message: int) -> list[tuple[str, Any]]:
    """The gRPC server's options: stream and queue limits (above), message sizes, keepalive."""
    queue = max(BACKLOG * max_streams, CORE_QUEUE_FLOOR)
    return [
        ("grpc.so_reuseport", 0),  # a port in use is an error, never shared
        ("grpc.max_concurrent_streams", max_streams),
        ("grpc.server.max_pending_requests", queue),
        ("grpc.server.max_pending_requests_hard_limit", queue),
        # a message is one body chunk (at most proxy.max_body_bytes) plus its framing; the
        # picker sends the chunks it receives back, so the same bound holds both ways
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        # a partitioned Envoy's connection is found by an unanswered ping and closed, its
        # streams (and flights) with it; epp.response_timeout_s bounds a live one
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]


class StreamGate:
    """The picker's count of open ext_proc streams: :meth:`enter` when one starts (what to do
    with it), :meth:`leave` when it ends, whatever it got."""

    def __init__(self, max_streams: int, metrics: EppMetrics) -> None:
        self.max_streams = max_streams
        self.backlog = BACKLOG * max_streams
        self.metrics = metrics
        self.open = 0
        self._refused = 0  # since the last warning line
        self._warned = -_WARN_EVERY_S

    def enter(self) -> str | None:
        """Count a new stream; None: serve it, else why it is refused (:data:`MAX_STREAMS`,
        :data:`OVERLOAD`)."""
        self.open += 1
        self.metrics.open_now(self.open)
        if self.open <= self.max_streams:
            return None
        reason = OVERLOAD if self.open > self.backlog else MAX_STREAMS
        self.metrics.refuse(reason)
        self._refused += 1
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            log.warning(
                "EPP refusing streams: %d since the last line (%d open; epp.max_streams %d, "
                "closed at once past %d)",
                self._refused, self.open, self.max_streams, self.backlog,
            )  # fmt: skip
            self._warned, self._refused = now, 0
        return reason

    def leave(self) -> None:
        self.open -= 1
        self.metrics.open_now(self.open)
