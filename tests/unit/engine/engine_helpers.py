"""Shared helpers for the engine tests: engines on real tiers, a real uvicorn server on port 0,
a real ZMQ subscriber that collects published batches, a real ``redis-server`` on a free port,
and ``wait_for`` (poll a condition with a timeout; never sleep for state)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
import zmq

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sequence import Request
from indexer.events import EventBatch
from indexer.index import PrefixIndex
from indexer.wire import decode_message
from tests.waiting import poll, wait_for

BS = 16


def make_engine(**kw: Any) -> LLMEngine:
    """A sim engine, 1000x faster than the timing model, with the given config overrides."""
    kw.setdefault("speedup", 1000.0)
    return LLMEngine(EngineConfig(**kw))


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def run(engine: LLMEngine, rid: str, tokens: list[int], max_tokens: int = 1, **kw: Any) -> Any:
    """Serve one request to completion on an otherwise idle engine; returns its last output."""
    engine.add_request(Request(rid, list(tokens), max_tokens=max_tokens, **kw))
    outs = [o for o in engine.run_until_idle() if o.request_id == rid]
    assert outs and outs[-1].finished
    return outs[-1]


class Collector:
    """A SUB socket on a publisher: every batch decoded with the wire decoder."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.batches: list[EventBatch] = []

    def drain(self, timeout_ms: int = 0) -> list[EventBatch]:
        new = []
        while self.sock.poll(timeout_ms):
            new.append(decode_message(self.sock.recv_multipart()))
            timeout_ms = 0
        self.batches.extend(new)
        return new

    def until_seq(self, seq: int, timeout: float = 20.0) -> None:
        def ok() -> bool:
            self.drain(10)
            return bool(self.batches) and self.batches[-1].seq >= seq

        poll(ok, timeout, f"published seq {seq}", every=0.002)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def connected(pub: Any, col: Collector, probe: Callable[[], None]) -> None:
    """ZMQ PUB drops messages until the SUB has joined: publish probes until one arrives."""

    def ok() -> bool:
        probe()
        return bool(col.drain(20))

    poll(ok, 20, "subscriber connected", every=0.002)


def index_of(batches: list[EventBatch], worker: str = "w") -> PrefixIndex:
    idx = PrefixIndex(BS)
    for b in batches:
        idx.apply_batch(worker, b)
    return idx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """A real redis-server on a free loopback port (retried if the port was taken meanwhile)."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    for _ in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            import redis

            client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)

            def up(client: redis.Redis = client, proc: subprocess.Popen[bytes] = proc) -> bool:
                if proc.poll() is not None:
                    return True
                try:
                    return bool(client.ping())
                except redis.RedisError:
                    return False

            poll(up, 20, "redis-server up", every=0.002)
            client.close()
            if proc.poll() is None:
                yield f"redis://127.0.0.1:{port}/0"
                return
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
    raise AssertionError("could not start redis-server on a free port")


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run an ASGI app with uvicorn on a free loopback port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: server.started or task.done(), 60, "uvicorn started")
        if task.done():
            task.result()
            raise AssertionError("server exited at startup")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
