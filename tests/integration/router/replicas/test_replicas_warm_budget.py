"""Issue 37, item 9: a warm start's decode under a budget, against a real snapshot server on
127.0.0.1 (``snapshot_peer``): a decode that outlasts ``warm_timeout_s`` stops (its thread
leaves the decoder soon after the cold start, instead of building the index to the end); a
snapshot over the index's own cap in entries, or a body over ``max_snapshot_bytes`` (chunked or
declared), is refused; and fuzzed snapshots over HTTP give a warm or a cold start,
never an exception."""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import msgspec

from indexer.hashing import HASH_VERSION
from router.runtime.replicas import warm_index
from router.settings import load_settings
from tests.unit.indexer.snapshot_mutations import BASE, PATHS, mutated
from tests.waiting import poll


def snapshot(ranks: int, per: int) -> bytes:
    """A valid snapshot of ``ranks`` x ``per`` entries, the fewest bytes an entry (small hashes:
    the most entries, so the longest decode, a body can carry)."""
    workers = []
    for r in range(ranks):
        eh = list(range(r * per, (r + 1) * per))
        workers.append(
            {
                "worker_id": f"w{r}",
                "dp_rank": 0,
                "model": "",
                "seq": 7,
                "ts": 1.0,
                "engine_hashes": eh,
                "router_hashes": eh,
                "tiers": [1] * per,
            }
        )
    head = {"format": "kvrouter-index-snapshot/1", "hash_version": HASH_VERSION, "block_size": 16}
    return msgspec.msgpack.encode({**head, "tiers": ["GPU"], "workers": workers})


def settings(url: str, **replicas: Any) -> Any:
    over = {"max_index_entries": replicas.pop("entries", 10_000_000)}
    return load_settings(
        environ={}, overrides={**over, "replicas": {"warm_from": [url], **replicas}}
    )


def decoding() -> bool:
    """Whether some thread is inside the snapshot decoder now."""
    for frame in sys._current_frames().values():
        f: Any = frame
        while f is not None:
            if "indexer/index/snapshot" in f.f_code.co_filename:
                return True
            f = f.f_back
    return False


async def test_a_decode_past_the_warm_timeout_stops_with_the_cold_start(snapshot_server, caplog):
    peer = await snapshot_server(snapshot(8, 400_000))  # ~2 s of decode on the dev machine
    t0 = time.monotonic()
    got = await warm_index(settings(peer.url, warm_timeout_s=0.6), [peer.url])
    took = time.monotonic() - t0
    assert got is None and took < 2.0
    assert "starting cold" in caplog.text
    poll(lambda: not decoding(), 0.5, "the decode thread gave up")


async def test_a_snapshot_over_the_entries_budget_is_refused(snapshot_server, caplog):
    peer = await snapshot_server(snapshot(2, 1000))
    assert await warm_index(settings(peer.url, entries=1500), [peer.url]) is None
    assert "over its budget of 1,500 entries" in caplog.text
    got = await warm_index(settings(peer.url, entries=2000), [peer.url])
    assert got is not None and got.index.entries() == 2000


async def test_a_body_over_the_limit_chunked_or_declared_is_refused(snapshot_server, caplog):
    body = snapshot(1, 2000)
    chunked = await snapshot_server(body, chunked=True)
    assert await warm_index(settings(chunked.url, max_snapshot_bytes=4096), [chunked.url]) is None
    assert "snapshot over 4096 bytes" in caplog.text
    got = await warm_index(settings(chunked.url), [chunked.url])  # (and whole, it is usable)
    assert got is not None and got.index.entries() == 2000
    declared = await snapshot_server(body)
    assert await warm_index(settings(declared.url, max_snapshot_bytes=4096), [declared.url]) is None
    assert f"snapshot of {len(body)} bytes over max_snapshot_bytes" in caplog.text


async def test_fuzzed_snapshots_over_http_start_warm_or_cold(snapshot_server):
    rng = random.Random(37)
    values = [-1, 2**64 - 1, -(2**63), None, "x", b"\xff" * 70, 1.5, [], {}]
    outcomes = set()
    for i in range(12):
        if i % 3 == 0:  # bit flips
            data = bytearray(BASE)
            for _ in range(rng.randrange(1, 6)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            body = bytes(data)
        elif i % 3 == 1:
            body = BASE[: rng.randrange(len(BASE))]
        else:
            body = mutated(rng.choice(PATHS), "replace", rng.choice(values))
        peer = await snapshot_server(body, chunked=bool(i % 2))
        got = await warm_index(settings(peer.url, warm_timeout_s=5), [peer.url])
        outcomes.add(got is not None)
    assert False in outcomes  # (some were refused: the mutations reach the decoder)
