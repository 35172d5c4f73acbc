"""The live replay's faulty path (issue 36): a ZMQ relay between one engine's KV event publisher
and the router that spoils the events the way :mod:`kvrouter.replay.faults` does in virtual time,
with no sequence gap, so nothing but the worker's own ``cached_tokens`` can tell.

An :class:`EventRelay` subscribes to the engine's PUB socket and republishes on its own (bound to a
free loopback port; the router's ``--worker`` spec names it as the worker's ``events``). Each
message keeps its seq: a batch stays one message, only the events inside it change, and a batch
left empty is still sent (an empty batch). That is why nothing is renumbered: the seqs the router
sees are the engine's own, so the engine's replay endpoint (which the router asks for a fresh
stream, and which is not the faulty path, as in virtual time) answers in the same numbering. What
it spoils, per message:

* ``drop_p``: each event is lost with that probability (stores and removals alike);
* ``silent_clears``: ``AllBlocksCleared`` never passes (a restarted cache the router is not told
  of; the fleet restarts it with ``POST /reset_prefix_cache``);
* ``reseed``: every stored block's token ids are shifted (:func:`kvrouter.replay.faults.salted`),
  as an engine hashing with another seed publishes them: the router chains its keys from the
  token ids, so those stores never match a prompt. (The bundled engine has no hash-seed option of
  its own: its hashes are the router's, from the token ids.)

Bounded: both sockets have a high-water mark of :data:`HWM` messages (past it ZMQ drops, as a
real PUB does), and the relay holds nothing else. One thread per relay; ``close`` stops it.

:func:`relayed_specs` sets a live fleet's faulty path up: kvrouter's ``--worker`` specs, the first
``no_events`` engines without events, each faulty one (the last K of each fault, as in virtual
time) through its own relay.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import TYPE_CHECKING

import zmq

from indexer.events import AllBlocksCleared, BlockStored, Event
from indexer.wire import WireError, decode_message, encode_message, encode_payload
from kvrouter.replay.faults import salted
from kvrouter.up import ENGINE_READY, worker_spec

if TYPE_CHECKING:
    from kvrouter.replay.fleet import Fleet

__all__ = ["HWM", "EventRelay", "relayed_specs"]

#: messages a relay's socket queues before ZMQ drops (the engine's own PUB default, 1000)
HWM = 1000


class EventRelay:
    """One engine's events, spoiled on the way (see the module docstring); a context manager."""

    def __init__(
        self,
        upstream: str,
        *,
        drop_p: float = 0.0,
        silent_clears: bool = False,
        reseed: bool = False,
        seed: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        if not 0 <= drop_p <= 1:
            raise ValueError(f"drop_p must be in [0, 1], got {drop_p}")
        self.drop_p, self.silent_clears, self.reseed = drop_p, silent_clears, reseed
        self._rng = random.Random(seed)
        #: events that did not pass, by type; messages that failed to decode (passed unchanged)
        self.dropped: Counter[str] = Counter()
        self.forwarded = 0
        self.undecodable = 0
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._pub = self._ctx.socket(zmq.PUB)
        for s in (self._sub, self._pub):
            s.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, HWM)
        self._pub.setsockopt(zmq.SNDHWM, HWM)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub.bind("tcp://127.0.0.1:*")
        #: where the router subscribes instead of the engine
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):  # (wakes to see _stop)
                    continue
                frames = self._sub.recv_multipart()
                self._pub.send_multipart(self.spoil(frames))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            self.forwarded += 1

    def spoil(self, frames: list[bytes]) -> list[bytes]:
        """One message's frames as the router gets them: the same topic and seq, its events
        spoiled. A message that does not decode passes as it is (the router judges it)."""
        if not (self.drop_p or self.silent_clears or self.reseed):
            return frames
        try:
            batch = decode_message(frames)
        except WireError:
            self.undecodable += 1
            return frames
        kept: list[Event] = []
        for ev in batch.events:
            if (self.silent_clears and type(ev) is AllBlocksCleared) or (
                self.drop_p and self._rng.random() < self.drop_p
            ):
                self.dropped[type(ev).__name__] += 1
                continue
            if self.reseed and type(ev) is BlockStored:
                ev = salted(ev)
            kept.append(ev)
        payload = encode_payload(kept, ts=batch.ts, dp_rank=batch.dp_rank)
        return encode_message(batch.topic, batch.seq, payload)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> EventRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def relayed_specs(fleet: Fleet) -> tuple[list[str], list[EventRelay]]:
    """kvrouter's ``--worker`` specs on ``fleet`` (:mod:`kvrouter.replay.fleet`): without events,
    through a relay, or the engine's own; and the relays, which close with the fleet."""
    s, f, n = fleet.spec, fleet.spec.faults, fleet.spec.workers
    specs, relays = [], []
    for i, (url, events, replay) in enumerate(fleet.endpoints):
        drop = f.drop_p if i >= n - f.drop_k else 0.0
        restart, reseed = i >= n - f.restart_k, i >= n - f.seed_k
        if i < s.no_events:
            events, replay = "none", "none"
        elif drop or restart or reseed:
            relay = EventRelay(
                events, drop_p=drop, silent_clears=restart, reseed=reseed, seed=s.seed + i
            )
            relays.append(fleet.exits.enter_context(relay))
            events, replay = relay.endpoint, "none" if reseed else replay
        # (the spec from an ENGINE_READY line naming these streams: worker_spec's one format)
        line = f"kvrouter engine ready http={url} events={events} replay={replay}"
        ready = ENGINE_READY.match(line)
        assert ready is not None
        specs.append(worker_spec(f"engine-{i}", ready))
    return specs, relays
