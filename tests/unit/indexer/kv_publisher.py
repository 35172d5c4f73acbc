"""A real KV event publisher for subscriber tests: PUB socket + ROUTER replay socket + bounded
replay buffer, speaking the vLLM >= 0.24 wire format through ``indexer.wire``'s encoder.

Also: a deterministic event stream generator, a reference-index builder, index comparison by
``match`` answers, and ``wait_for`` (poll a condition with a timeout; never sleep for state).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from indexer.events import BlockRemoved, BlockStored, Event, EventBatch
from indexer.index import PrefixIndex, WorkerKey
from indexer.wire import (
    decode_payload,
    decode_replay_request,
    encode_message,
    encode_payload,
    encode_replay_end,
    encode_replay_reply,
)
from indexer.wire.frames import END_SEQ, pack_seq

BLOCK = 16
LOCAL = "tcp://127.0.0.1"


class StreamGen:
    """Random but seeded stores (1-4 blocks, from the root or extending a known chain) and
    single-block removals, remembering every chain's tokens for later queries."""

    def __init__(self, seed: int, *, remove_ratio: float = 0.2, tier: str = "GPU") -> None:
        self.rng = random.Random(seed)
        self.remove_ratio = remove_ratio
        self.medium = None if tier == "GPU" else tier
        self.paths: list[tuple[list[int], int]] = []  # (tokens from the root, last engine hash)
        self.stored: list[int] = []

    def events(self) -> list[Event]:
        rng = self.rng
        if self.stored and rng.random() < self.remove_ratio:
            i = rng.randrange(len(self.stored))
            self.stored[i], self.stored[-1] = self.stored[-1], self.stored[i]
            return [BlockRemoved(block_hashes=[self.stored.pop()], medium=self.medium)]
        if self.paths and rng.random() < 0.7:
            tokens, parent = self.paths[rng.randrange(len(self.paths))]
        else:
            tokens, parent = [], None
        n = rng.randint(1, 4)
        new_tokens = [rng.randrange(50_000) for _ in range(n * BLOCK)]
        hashes = [rng.getrandbits(64) for _ in range(n)]
        self.stored.extend(hashes)
        if len(self.paths) < 400:
            self.paths.append((tokens + new_tokens, hashes[-1]))
        return [
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=new_tokens,
                block_size=BLOCK,
                medium=self.medium,
            )
        ]

    def queries(self) -> list[list[int]]:
        return [tokens for tokens, _ in self.paths]


class EventPublisher:
    """One dp rank of a worker: PUB on ``events``, optional ROUTER replay on ``replay``."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        replay: bool = True,
        topic: bytes = b"kv-events",
        topic_in_replies: bool = True,
        buffer: int = 10_000,
        dp_rank: int = 0,
        events_addr: str = f"{LOCAL}:*",
        replay_addr: str = f"{LOCAL}:*",
    ) -> None:
        self.topic = topic
        self.topic_in_replies = topic_in_replies
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        #: Every batch of the current publisher "process", as the subscriber should decode it.
        self.batches: list[EventBatch] = []
        #: "answer" (default) or "silent": take replay requests and never reply.
        self.replay_mode = "answer"
        #: Seconds the replay server takes before answering (a slow publisher).
        self.reply_delay = 0.0
        self.replay_requests: list[int] = []
        self.pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB, socket_class=zmq.Socket)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        try:
            self.pub.bind(events_addr)
        except zmq.ZMQError:
            self.pub.close(linger=0)
            raise
        self.events = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router: zmq.asyncio.Socket | None = None
        self.replay: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay:
            try:
                self.router = ctx.socket(zmq.ROUTER)
                self.router.setsockopt(zmq.LINGER, 0)
                self.router.bind(replay_addr)
            except zmq.ZMQError:
                self.close()
                raise
            self.replay = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.get_running_loop().create_task(self._serve())

    def publish(self, events: Sequence[Event], *, drop: bool = False) -> int:
        """Publish one batch (``drop``: keep it for replay but do not send it live)."""
        seq = self.seq
        self.seq += 1
        payload = encode_payload(events, ts=time.time(), dp_rank=self.dp_rank)
        self.buffer.append((seq, payload))
        self.batches.append(decode_payload(payload, seq=seq, topic=self.topic))
        if not drop:
            self.pub.send_multipart(encode_message(self.topic, seq, payload))
        return seq

    def send_raw(self, frames: Sequence[bytes]) -> None:
        self.pub.send_multipart(list(frames))

    def restart(self) -> None:
        """What a new publisher process looks like: seq from 0, nothing buffered."""
        self.seq = 0
        self.buffer.clear()
        self.batches = []

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            start = decode_replay_request(frames)
            self.replay_requests.append(start)
            if self.replay_mode != "answer":
                continue
            ident = frames[0]
            if self.reply_delay:
                await asyncio.sleep(self.reply_delay)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    reply = encode_replay_reply(self.topic, seq, payload)
                    if not self.topic_in_replies:
                        reply = [b"", pack_seq(seq), payload]
                    await self.router.send_multipart([ident, *reply])
            end = encode_replay_end(b"")
            if not self.topic_in_replies:
                end = [b"", pack_seq(END_SEQ), b""]
            await self.router.send_multipart([ident, *end])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.router is not None:
            self.router.close(linger=0)
        self.pub.close(linger=0)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.close()


def dp_publishers(ctx: zmq.asyncio.Context, ranks: int, **kw: Any) -> list[EventPublisher]:
    """Publishers for ranks 0..ranks-1 on consecutive ports (events and replay alike)."""
    for _ in range(50):
        first = EventPublisher(ctx, dp_rank=0, **kw)
        pubs = [first]
        ev_port = int(first.events.rsplit(":", 1)[1])
        rp_port = int(first.replay.rsplit(":", 1)[1]) if first.replay else 0
        try:
            for r in range(1, ranks):
                pubs.append(
                    EventPublisher(
                        ctx,
                        dp_rank=r,
                        events_addr=f"{LOCAL}:{ev_port + r}",
                        replay_addr=f"{LOCAL}:{rp_port + r}",
                        **kw,
                    )
                )
            return pubs
        except zmq.ZMQError:
            for p in pubs:
                p.close()
    raise AssertionError("no consecutive free ports")


class RecordingIndex(PrefixIndex):
    """A real PrefixIndex that also records which seqs were applied, per worker rank."""

    def __init__(self, block_size: int = BLOCK) -> None:
        super().__init__(block_size)
        self.applied: dict[WorkerKey, list[int]] = {}

    def apply_batch(self, worker_id: str, batch: EventBatch, *, dp_rank: int | None = None) -> None:
        key = (worker_id, dp_rank if dp_rank is not None else (batch.dp_rank or 0))
        self.applied.setdefault(key, []).append(batch.seq)
        super().apply_batch(worker_id, batch, dp_rank=dp_rank)


def reference(
    batches_by_key: dict[WorkerKey, Sequence[EventBatch]],
    clear_before: dict[WorkerKey, int] | None = None,
) -> PrefixIndex:
    """The index a loss-free subscriber would build (``clear_before``: a clear before that seq)."""
    clear_before = clear_before or {}
    ref = PrefixIndex(BLOCK)
    for key, batches in batches_by_key.items():
        ref.add_worker(*key)
        for b in batches:
            if clear_before.get(key) == b.seq:
                ref.clear_worker(*key)
            ref.apply_batch(key[0], b, dp_rank=key[1])
    return ref


def assert_same_index(
    got: PrefixIndex, want: PrefixIndex, keys: Sequence[WorkerKey], queries: Sequence[list[int]]
) -> None:
    """Same per-worker match answers for every query and the same blocks per tier (orphan counts
    are cumulative, so they only agree for a loss-free run: compare those in the test)."""
    assert queries
    for key in keys:
        g, w = got.worker_stats(key), want.worker_stats(key)
        assert g.blocks_by_tier == w.blocks_by_tier, key
    nonzero = 0
    for tokens in queries:
        rg = got.match(got.request_hashes(tokens))
        rw = want.match(want.request_hashes(tokens))
        for key in keys:
            assert rg.workers[key] == rw.workers[key], (key, len(tokens))
            nonzero += rg.workers[key].matched_blocks > 0
    assert nonzero > 0  # the comparison must have looked at something present
