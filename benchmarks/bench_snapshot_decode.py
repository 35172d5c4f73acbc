"""Memory and time of a warm start's snapshot decode (issue 37, item 9): the peak RSS over the
process's RSS before, what stays resident after, and the wall time, for a snapshot of
``--entries`` (engine block, worker) entries in ``--ranks`` ranks.

Run (each measurement in a fresh child process, so one peak does not hide another; about a
minute on the 2-core dev machine at the default size):

    python benchmarks/bench_snapshot_decode.py                       # 2 M entries, 8 ranks
    python benchmarks/bench_snapshot_decode.py --entries 4000000 --ranks 1

Modes: ``body-join`` and ``body-buffer`` read a ``--body-mib`` chunked body only, the first as
``UpstreamResponse.read`` does (chunks, then one join: the body twice at the end), the second as
the warm start does now (one buffer grown in place); ``decode`` is ``PrefixIndex.from_snapshot_bytes`` on bytes already read;
``warm`` is a whole warm start (:func:`router.runtime.replicas.warm_index`) from a real aiohttp
server on 127.0.0.1 that sends the snapshot chunked (no Content-Length), with
``max_index_entries`` = ``--entries`` so the budget lets it all in. ``amplification`` is peak
RSS growth over the snapshot's bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from indexer.hashing import HASH_VERSION  # noqa: E402


def make(entries: int, ranks: int, seed: int = 0, small: bool = False) -> bytes:
    """A valid snapshot: random 64-bit engine and router hashes (``small``: consecutive ones,
    the fewest bytes an entry), every block on the GPU."""
    rng = random.Random(seed)
    per = entries // ranks
    workers = []
    for r in range(ranks):
        eh = (
            list(range(r * per, (r + 1) * per))
            if small
            else [rng.getrandbits(63) for _ in range(per)]
        )
        workers.append(
            {
                "worker_id": f"w{r // 8}",
                "dp_rank": r % 8,
                "model": "m",
                "seq": 100,
                "ts": 1.5,
                "engine_hashes": eh,
                "router_hashes": eh if small else [rng.getrandbits(63) for _ in range(per)],
                "tiers": [1] * per,
            }
        )
    head = {"format": "kvrouter-index-snapshot/1", "hash_version": HASH_VERSION}
    return msgspec.msgpack.encode({**head, "block_size": 16, "tiers": ["GPU"], "workers": workers})


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM back to the current RSS
        f.write("5")


def child(mode: str, path: str, entries: int) -> dict:
    data_len = os.path.getsize(path)
    if mode == "decode":
        from indexer.index import PrefixIndex

        with open(path, "rb") as f:
            data = f.read()
        gc.collect()
        _reset_peak()
        base = _status("VmRSS")
        t0 = time.perf_counter()
        index, _ = PrefixIndex.from_snapshot_bytes(data)
        took = time.perf_counter() - t0
        del data
    elif mode.startswith("body"):
        base, took, got = asyncio.run(_body(path, mode))
        peak = _status("VmHWM")
        return {
            "mode": mode,
            "body_mib": round(got / 2**20, 1),
            "seconds": round(took, 2),
            "peak_mib": round((peak - base) / 2**20, 1),
        }
    else:
        index, base, took = asyncio.run(_warm(path, entries))
    peak = _status("VmHWM")
    gc.collect()
    after = _status("VmRSS")
    n = index.entries()
    return {
        "mode": mode,
        "snapshot_mib": round(data_len / 2**20, 1),
        "entries": n,
        "seconds": round(took, 2),
        "peak_mib": round((peak - base) / 2**20, 1),
        "resident_mib": round((after - base) / 2**20, 1),
        "amplification": round((peak - base) / data_len, 1),
    }


async def _serve(path: str) -> tuple:
    """A real aiohttp server on 127.0.0.1 sending ``path`` chunked; (runner, its URL)."""
    from aiohttp import web

    from router.runtime.replicas import SNAPSHOT_PATH, SNAPSHOT_TYPE

    async def serve(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": SNAPSHOT_TYPE})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                await resp.write(chunk)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get(SNAPSHOT_PATH, serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _body(path: str, mode: str) -> tuple[int, float, int]:
    from router.fleet.upstream import UpstreamPool
    from router.runtime.replicas import SNAPSHOT_PATH
    from router.runtime.replicas.warm import _read_body

    runner, url = await _serve(path)
    pool = UpstreamPool(connect_s=5, read_s=600, write_s=5, max_body_bytes=1 << 40)
    gc.collect()
    _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    resp = await pool.request(url, "GET", SNAPSHOT_PATH, [], b"")
    data = await (resp.read(1 << 40) if mode == "body-join" else _read_body(resp, 1 << 40))
    took = time.perf_counter() - t0
    await resp.aclose()
    await pool.aclose()
    await runner.cleanup()
    return base, took, len(data)


async def _warm(path: str, entries: int) -> tuple:
    from router.runtime.replicas import warm_index
    from router.settings.config import _convert

    runner, url = await _serve(path)
    size = os.path.getsize(path)
    settings = _convert(
        {
            "max_index_entries": entries,
            "replicas": {
                "warm_from": [url],
                "warm_timeout_s": 600,
                "max_snapshot_bytes": max(size, 1024),
            },
        }
    )
    gc.collect()
    _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    got = await warm_index(settings, [url])
    took = time.perf_counter() - t0
    await runner.cleanup()
    assert got is not None, "the warm start went cold"
    return got.index, base, took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=2_000_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--modes", default="decode,warm,body-join,body-buffer")
    ap.add_argument("--body-mib", type=int, default=256)
    ap.add_argument("--small", action="store_true", help="small hashes: most entries a byte")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "PATH", "ENTRIES"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], int(a.child[2]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "index.snap")
        with open(path, "wb") as f:
            f.write(make(a.entries, a.ranks, small=a.small))
        body = os.path.join(tmp, "body")
        with open(body, "wb") as f:
            for _ in range(a.body_mib):
                f.write(os.urandom(1 << 20))
        for mode in a.modes.split(","):
            src = body if mode.startswith("body") else path
            cmd = [sys.executable, __file__, "--child", mode, src, str(a.entries)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
