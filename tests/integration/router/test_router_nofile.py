"""The connection cap under a low file descriptor limit (issue 21), on a real ``kvrouter serve``
process started with ``RLIMIT_NOFILE`` 128 (soft) / 256 (hard): the router raises its soft
limit to the hard one, derives its cap from it (one log line), answers connections past the cap
503 at once instead of running out of descriptors, and still reaches its worker meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
LINE = re.compile(rb"kvrouter router listening on http://127\.0\.0\.1:(\d+)")
READY = b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n"
CAP = re.compile(r"connections: at most (\d+) clients .*RLIMIT_NOFILE 256 \(raised from 128\)")


# The limit is set by a launcher that then execs the router, not by a preexec_fn: a preexec_fn
# makes the child a plain fork that runs Python, and a pytest process that has loaded gRPC (the
# EPP tests) has fork handlers that can break that child before its exec (seen: gRPC's poller
# failing in it, the router never starting).
LOW_NOFILE = (
    "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (128, 256)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


async def _request(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], raw: bytes) -> bytes:
    """One keep-alive exchange: the answer's head and body (by its Content-Length)."""
    reader, writer = conn
    writer.write(raw)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    m = re.search(rb"(?i)content-length: (\d+)", head)
    assert m, head
    length = int(m.group(1))
    return head + await asyncio.wait_for(reader.readexactly(length), 20)


async def test_connections_past_the_cap_get_503_and_workers_stay_reachable(tmp_path, workers):
    w = await workers("w")
    cfg = tmp_path / "r.yaml"  # idle connections are held open longer than the test runs
    cfg.write_text(
        "server:\n  head_timeout_s: 60\n  keep_alive_timeout_s: 60\nhealth:\n  interval_s: 0.2\n"
    )
    spec = f"id=w,url={w.url},events={w.events_endpoint},replay={w.replay_endpoint}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LOW_NOFILE, "-m", "router", "serve", "--config", str(cfg),
        "--port", "0", "--worker", spec, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(env, PYTHONPATH=str(ROOT)), cwd=str(ROOT),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    log: list[str] = []

    async def drain(stream: asyncio.StreamReader) -> None:  # (a full pipe would stall it)
        while line := await stream.readline():
            log.append(line.decode(errors="replace"))

    drainer = asyncio.create_task(drain(proc.stderr))
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        m = LINE.search(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert m, log
        port = int(m.group(1))
        found = lambda: [c for line in log if (c := CAP.search(line))]  # noqa: E731
        await wait_for(found, 20, "the connection cap's log line")  # (stderr, read apart)
        cap = int(found()[0].group(1))
        assert 16 <= cap < 128, cap  # below the raised limit, with room kept for the rest

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            held.append(await asyncio.open_connection("127.0.0.1", port))
            return held[-1]

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        active = await connect()
        while not (await _request(active, READY)).startswith(b"HTTP/1.1 200 "):
            assert loop.time() < deadline, "never ready"
        for _ in range(cap - 1):  # the cap's worth of connections, idle but one
            await connect()
        # many more, past the cap and past the limit itself: each a 503 at once, then EOF
        for _ in range(300):
            reader, _ = await connect()
            answer = await asyncio.wait_for(reader.read(), 20)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["type"] == "service_unavailable"
        # meanwhile the router still reaches its worker: a proxied request on a held connection
        body = json.dumps({"model": w.model, "prompt": "hello"}).encode()
        answer = await _request(
            active,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
        )
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert len(w.requests) == 1
        assert (await _request(active, READY)).startswith(b"HTTP/1.1 200 ")  # health checks too
        for _, writer in held:
            writer.close()
        held.clear()
        # once they are gone, a fresh client is served (as soon as the router saw them close)
        deadline = loop.time() + 20
        while not (await _request(await connect(), READY)).startswith(b"HTTP/1.1 200 "):
            assert loop.time() < deadline, "a fresh client never served"
    finally:
        for _, writer in held:
            writer.close()
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
        await drainer
    assert not [line for line in log if "Traceback" in line or "Too many open files" in line]
