"""Shared fixtures of the indexer tests: a ZMQ context, publishers closed after each test, and
helpers driving a real Subscriber against them."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from indexer.index import PrefixIndex, WorkerKey
from indexer.subscriber import Subscriber, WorkerEndpoint
from tests.unit.indexer.kv_publisher import EventPublisher, StreamGen
from tests.waiting import wait_for


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
async def pubs(ctx: zmq.asyncio.Context) -> AsyncIterator[list[EventPublisher]]:
    """Publishers created by a test; closed after it."""
    made: list[EventPublisher] = []
    yield made
    for p in made:
        await p.aclose()


def endpoint(wid: str, pub: EventPublisher, **kw: object) -> WorkerEndpoint:
    return WorkerEndpoint(wid, pub.events, pub.replay, **kw)  # type: ignore[arg-type]


async def started(index: PrefixIndex, ctx: zmq.asyncio.Context, **kw: float) -> Subscriber:
    sub = Subscriber(index, context=ctx, **kw)
    await sub.start()
    return sub


def live_applied(sub: Subscriber, key: WorkerKey) -> int:
    st = sub.stats()[key]
    return st.messages - st.replayed


async def sync_live(pub: EventPublisher, sub: Subscriber, key: WorkerKey) -> None:
    """Publish empty probes until one is applied from the live stream: past the slow-joiner
    window (a PUB drops what it sends before the subscription reaches it)."""
    await wait_for(lambda: sub.stats()[key].connected, what=f"{key} connected")
    deadline = time.monotonic() + 20
    before = live_applied(sub, key)
    while True:
        pub.publish([])
        try:
            await wait_for(lambda: live_applied(sub, key) > before, 0.3)
            await wait_for(lambda: sub.stats()[key].last_seq == pub.seq - 1)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise


async def stream(pub: EventPublisher, gen: StreamGen, n: int, drop: float = 0.0) -> None:
    rng = random.Random(n)
    for i in range(n):
        pub.publish(gen.events(), drop=rng.random() < drop)
        if i % 64 == 63:
            await asyncio.sleep(0)  # let the subscriber task run between bursts


async def caught_up(sub: Subscriber, key: WorkerKey, pub: EventPublisher) -> None:
    await wait_for(
        lambda: sub.stats()[key].last_seq == pub.seq - 1 and not sub.stats()[key].replaying,
        what=f"{key} at seq {pub.seq - 1}",
    )
