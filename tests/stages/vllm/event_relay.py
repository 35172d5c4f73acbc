"""A ZMQ relay between a real vLLM's KV event publisher and the router, that can lose stores
silently: what the vLLM stage's closed-loop test puts on the way (issue 36).

vLLM publishes ``(topic, seq, payload)`` on a PUB socket (and keeps a replay ROUTER the relay
leaves alone). The relay SUBscribes to it and republishes every message on its own PUB, with the
same sequence number. While :attr:`EventRelay.dropping` is set it takes the ``BlockStored`` events
out of each batch and sends the rest: the router sees every sequence number, so no gap says that
anything was lost — the silent loss the loop must notice from the worker's own ``cached_tokens``.
Dropping events within a batch, rather than whole messages, keeps vLLM's numbering intact, so a
replay the router asks of vLLM itself (which the relay does not filter) continues the stream.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq


class EventRelay:
    """Run with ``with EventRelay(...) as relay``: a thread owns both sockets (a ZMQ socket is
    not thread-safe), and the test flips :attr:`dropping` from its own thread."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.dropping = threading.Event()
        self.forwarded = 0  # messages republished
        self.dropped = 0  # BlockStored events taken out
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, name="event-relay", daemon=True)
        self.endpoint = ""

    def __enter__(self) -> EventRelay:
        self._thread.start()
        # the thread binds its PUB; it reports the endpoint once it can be connected to
        assert self._bound.wait(10), "the relay did not bind"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        ctx = zmq.Context()
        sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.upstream)
            pub.bind("tcp://127.0.0.1:0")
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bound.set()
            while not self._stop.is_set():
                if not sub.poll(100):  # wakes to see the stop flag
                    continue
                topic, seq, payload = sub.recv_multipart()
                if self.dropping.is_set():
                    payload = self._without_stores(payload)
                pub.send_multipart((topic, seq, payload))
                self.forwarded += 1
        finally:
            sub.close(0)
            pub.close(0)
            ctx.term()

    def _without_stores(self, payload: bytes) -> bytes:
        """The batch ``[ts, events, dp_rank]`` without its ``BlockStored`` events; everything
        else as it was."""
        batch: list[Any] = msgspec.msgpack.decode(payload)
        kept = [e for e in batch[1] if _tag(e) != "BlockStored"]
        self.dropped += len(batch[1]) - len(kept)
        batch[1] = kept
        return msgspec.msgpack.encode(batch)


def _tag(event: Any) -> Any:
    """An event's type: vLLM 0.32 sends maps tagged ``type``; older ones and other publishers
    positional arrays, the tag first (:mod:`indexer.wire.decode` reads both)."""
    if isinstance(event, dict):
        return event.get("type")
    return event[0] if isinstance(event, list) and event else None
