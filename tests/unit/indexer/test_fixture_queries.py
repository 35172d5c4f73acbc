"""Every wire fixture stream, decoded and applied to the index, answers its `queries` as expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from indexer.index import PrefixIndex
from indexer.wire import decode_message

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "wire"
STREAMS = sorted(
    p.name
    for p in FIXTURES.glob("*.json")
    if json.loads(p.read_text()).get("format") == "kv-event-wire-stream/1"
)


def test_all_streams_found() -> None:
    assert len(STREAMS) == 10


@pytest.mark.parametrize("name", STREAMS)
def test_stream_queries(name: str) -> None:
    fx = json.loads((FIXTURES / name).read_text())
    idx = PrefixIndex(fx["block_size"])
    for rank in (0, 1):
        idx.add_worker("w", rank)
    queries = {q["after_seq"]: q for q in fx["expected"]["queries"]}
    checked = 0
    for msg in fx["messages"]:
        batch = decode_message([bytes.fromhex(f) for f in msg["frames_hex"]])
        idx.apply_batch("w", batch)
        q = queries.get(batch.seq)
        if q is None:
            continue
        for rank, chains in q["dp_ranks"].items():
            key = ("w", int(rank))
            for chain, want in chains.items():
                hashes = idx.request_hashes(fx["chains"][chain]["token_ids"])
                assert len(hashes) == want["total_blocks"]
                got = idx.match(hashes).workers[key]
                where = f"{name} after seq {batch.seq} ({q['step']}) rank {rank} chain {chain}"
                assert got.matched_blocks == want["matched_blocks"], where
                tiers = idx.block_tiers(key, hashes)[: got.matched_blocks]
                assert [sorted(t) for t in tiers] == [sorted(t) for t in want["tiers"]], where
                checked += 1
    assert checked == len(queries) * 2 * len(fx["chains"])
    for rank in (0, 1):
        assert idx.worker_stats(("w", rank)).orphans == 0
