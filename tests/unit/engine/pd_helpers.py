"""Prefill/decode engines for the PD tests: real ``python -m engine`` processes on port 0, each
with its ready line parsed (HTTP URL, event and replay endpoints, block endpoint), and a reader
of an engine's published KV events through its replay socket (every batch since seq 0)."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import zmq

from indexer.events import BlockStored
from indexer.wire import decode_payload, decode_replay_reply, encode_replay_request
from kvrouter.up import ENGINE_READY, Child, spawn, stop_children
from router.edge.legs import NIXL_PREFILL

__all__ = ["PREFILL_LEG", "Engine", "engines", "gpu_stores"]

#: what the router puts in the prefill leg (its ``nixl`` protocol, vLLM's toy proxy's)
PREFILL_LEG: dict[str, Any] = NIXL_PREFILL


@dataclass
class Engine:
    child: Child
    url: str
    events: str
    replay: str
    kv: tuple[str, int] | None

    def post(self, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60)

    def transfers(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/debug/kv_transfers", timeout=10)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]


@contextlib.contextmanager
def engines(*argvs: list[str], timeout: float = 120) -> Iterator[list[Engine]]:
    """Start one engine per argument list (all at once), yield them once all are ready."""
    children: list[Child] = []
    try:
        for i, argv in enumerate(argvs):
            cmd = [sys.executable, "-m", "engine", "--port", "0", "--events", "tcp://127.0.0.1:0"]
            cmd += ["--replay", "tcp://127.0.0.1:0", "--log-level", "warning", *argv]
            children.append(spawn(f"engine-{i}", cmd, log=io.StringIO()))
        out = []
        for c in children:
            m = c.wait_line(ENGINE_READY, timeout, threading.Event())
            kv = re.search(r" kv=(\S+):(\d+)", m.string)
            out.append(
                Engine(c, m.group(1), m.group(2), m.group(3), (kv[1], int(kv[2])) if kv else None)
            )
        yield out
    finally:
        stop_children(children)


def replayed(endpoint: str) -> list[Any]:
    """Every event the engine published since it started, in order (its replay buffer)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    events: list[Any] = []
    try:
        sock.send_multipart(encode_replay_request(0))
        while True:
            assert sock.poll(10_000), "no replay reply"
            r = decode_replay_reply(sock.recv_multipart())
            if r.is_end:
                return events
            events.extend(decode_payload(r.payload).events)
    finally:
        sock.close(0)
        ctx.term()


def gpu_stores(replay: str, tier: str = "GPU") -> list[list[int]]:
    """The token ids of each block an engine said it stored on GPU (or ``tier``), in order (from
    its replay endpoint)."""
    out = []
    for ev in replayed(replay):
        if isinstance(ev, BlockStored) and ev.tier == tier:
            bs = ev.block_size
            out.extend(ev.token_ids[i : i + bs] for i in range(0, len(ev.token_ids), bs))
    return out
