"""KV event publisher: ZMQ PUB of ``[topic, seq, payload]`` plus a ROUTER replay socket.

Payloads are vLLM >= 0.24 map-format batches (``indexer.wire.encode_payload``), one per engine
step that changed the cache, stamped with the dp rank. ``seq`` starts at 0 in every process (a
subscriber seeing it go backwards knows the cache restarted empty) and grows by one per message.
The last ``buffer_size`` messages are kept for replay: a DEALER sends ``[b"", start_seq]`` and gets
every buffered message from there as ``[b"", topic, seq, payload]`` (vLLM >= 0.26 layout), then the
end marker (seq -1, empty payload).

``publish`` is called from one thread (the engine loop); the replay socket is served by a
background thread; the buffer between them is guarded by a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from indexer.events import Event
from indexer.wire import (
    WireError,
    decode_replay_request,
    encode_message,
    encode_payload,
    encode_replay_end,
    encode_replay_reply,
)

__all__ = ["EventPublisher", "PublisherError", "bindable"]

log = logging.getLogger("engine.publisher")


class PublisherError(RuntimeError):
    """A socket could not be bound."""


def bindable(endpoint: str) -> str:
    """``tcp://host:0`` → ``tcp://host:*`` (ZMQ's spelling of 'any free port')."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


class EventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str | bytes = b"kv-events",
        dp_rank: int | None = 0,
        buffer_size: int = 10000,
        context: zmq.Context | None = None,
    ) -> None:
        self.topic = topic.encode() if isinstance(topic, str) else topic
        self.dp_rank = dp_rank
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replays = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router: zmq.Socket | None = None
        try:
            self._pub.bind(bindable(endpoint))
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(bindable(replay_endpoint))
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise PublisherError(f"cannot bind the event sockets: {exc}") from exc
        if self._router is not None:
            self._thread = threading.Thread(
                target=self._serve_replay, name="kv-replay", daemon=True
            )
            self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[Event], *, ts: float | None = None) -> int | None:
        """Send one batch; returns its seq (None when ``events`` is empty)."""
        if not events:
            return None
        payload = encode_payload(events, ts=time.time() if ts is None else ts, dp_rank=self.dp_rank)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        self._pub.send_multipart(encode_message(self.topic, seq, payload))
        return seq

    def _serve_replay(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._router.recv_multipart()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.warning("replay socket error: %s", exc)
                continue
            identity = frames[0]
            try:
                start = decode_replay_request(frames)
            except WireError as exc:
                log.warning("bad replay request: %s", exc)
                continue
            with self._lock:
                buffered = [(s, p) for s, p in self._buffer if s >= start]
            self.replays += 1
            try:
                for s, p in buffered:
                    self._router.send_multipart([identity, *encode_replay_reply(self.topic, s, p)])
                self._router.send_multipart([identity, *encode_replay_end()])
            except zmq.ZMQError as exc:  # the requester went away mid-reply
                log.warning("replay to a subscriber failed: %s", exc)

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close_sockets()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
