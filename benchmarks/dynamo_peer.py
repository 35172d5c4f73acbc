"""NVIDIA Dynamo's standalone KV indexer as ``bench_vs_dynamo.py``'s peer: started from its own
virtual environment (never a dependency of this repository), probed for health, asked ``/query``
and ``/metrics``, and fed events whose block hashes derive from content, as vLLM's do
(``content_addressed``). Its ``--block-size`` and ``--model-name`` are ``BS`` and ``MODEL``."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from array import array
from typing import IO, Any

import msgspec
from bench_route import Client

from indexer.events import BlockStored, EngineHash

BS = 16
MODEL = "default"  # Dynamo's indexer key (--model-name); /query must name it


def free_port() -> int:
    """A port the kernel considers free now (Dynamo's --port 0 binds, but never says which)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_dynamo(
    python: str, spec: str, threads: int | None, log: IO[bytes]
) -> tuple[subprocess.Popen[bytes], str]:
    extra = [] if threads is None else ["--threads", str(threads)]
    for _ in range(3):  # another process may take the port between our probe and its bind
        port = free_port()
        args = [python, "-m", "dynamo.indexer", "--port", str(port), "--block-size", str(BS),
                "--model-name", MODEL, "--workers", spec, *extra]  # fmt: skip
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            if _healthy(proc, url, 60):
                return proc, url
        except BaseException:
            stop(proc)
            raise
        stop(proc)
    raise SystemExit("Dynamo's indexer did not start")


def _healthy(proc: subprocess.Popen[bytes], url: str, timeout: float) -> bool:
    """``GET /health`` answers 200 before ``timeout``; False once the process has exited."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            c = Client(url)
        except OSError:  # not listening yet
            time.sleep(0.05)
            continue
        try:
            if c.call("GET", "/health")[0] == 200:
                return True
        finally:
            c.sock.close()
    return False


def dynamo_scores(c: Client, tokens: list[int]) -> dict[int, int]:
    """``/query`` per-worker overlap in blocks (Dynamo answers matched tokens, dp rank 0 here)."""
    body = json.dumps({"token_ids": tokens, "model_name": MODEL}).encode()
    status, data, _ = c.call("POST", "/query", body)
    if status != 200:
        raise SystemExit(f"Dynamo /query answered {status}: {data[:300]!r}")
    out = {}
    for wid, ranks in json.loads(data)["scores"].items():
        toks = ranks.get("0", 0)
        if toks % BS:
            raise SystemExit(f"Dynamo scored worker {wid} {toks} tokens, not whole blocks")
        out[int(wid)] = toks // BS
    return out


def dynamo_stored(c: Client) -> dict[str, int]:
    """Dynamo's ``kv_cache_events_applied`` counter for stores, by outcome."""
    out: dict[str, int] = {}
    prefix = 'dynamo_kvrouter_kv_cache_events_applied{event_type="stored",status="'
    for line in c.call("GET", "/metrics")[1].decode().splitlines():
        if line.startswith(prefix):
            status = line[len(prefix) :].split('"', 1)[0]
            out[status] = int(float(line.rsplit(" ", 1)[1]))
    return out


def dynamo_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('ai-dynamo-runtime'))"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or "?"


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _content_hash(parent: int | None, tokens: list[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def content_addressed(streams: list[list[list[Any]]]) -> list[list[list[Any]]]:
    """The same events with content-derived block hashes (same tokens, same parent -> same hash,
    on every worker), as vLLM publishes them with a fixed hash seed."""
    out = []
    for stream in streams:
        new_of: dict[EngineHash, int] = {}
        batches = []
        for batch in stream:
            events = []
            for ev in batch:
                assert isinstance(ev, BlockStored), ev
                parent = None if ev.parent_block_hash is None else new_of[ev.parent_block_hash]
                prev, hashes = parent, []
                for i, old in enumerate(ev.block_hashes):
                    prev = _content_hash(prev, ev.token_ids[i * BS : (i + 1) * BS])
                    new_of[old] = prev
                    hashes.append(prev)
                events.append(
                    msgspec.structs.replace(ev, block_hashes=hashes, parent_block_hash=parent)
                )
            batches.append(events)
        out.append(batches)
    return out


def sentinel(token: int) -> tuple[BlockStored, list[int]]:
    tokens = [token] * BS
    return BlockStored([_content_hash(None, tokens)], None, tokens, BS), tokens
