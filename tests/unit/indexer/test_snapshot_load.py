"""The snapshot decoder's bounds (issue 37, items 7 and 9): duplicate-store counts clamped (a
huge one pinned a removed block for good), columns of one length, and the decode budget's
entries, deadline and cancel flag, each a ``SnapshotError``."""

from __future__ import annotations

import time

import msgspec
import pytest
from snapshot_mutations import BASE

from indexer.events import BlockRemoved, BlockStored, EventBatch
from indexer.index import DecodeBudget, PrefixIndex, SnapshotError
from indexer.index.snapshot_load import MAX_RESTORED_DUPS


def test_a_huge_duplicate_store_count_no_longer_pins_a_removed_block() -> None:
    ix = PrefixIndex(16)
    toks = list(range(16))
    ix.apply_batch("w", EventBatch(0, 1.0, [BlockStored([5], None, toks, 16)]))
    ix.apply_batch("w", EventBatch(1, 1.0, [BlockStored([5], None, toks, 16)]))  # a real dup
    h = ix.request_hashes(toks)[0]
    obj = msgspec.msgpack.decode(ix.snapshot_bytes({("w", 0): 1}))
    assert obj["workers"][0]["dups"] == [[5, 0, 1]]
    obj["workers"][0]["dups"] = [[5, 0, 10**12]]  # the poison: removals never reach 0
    restored, _ = PrefixIndex.from_snapshot_bytes(msgspec.msgpack.encode(obj))
    assert restored.worker(("w", 0)).dups == {5: {0: MAX_RESTORED_DUPS}}
    for seq in range(2, 2 + MAX_RESTORED_DUPS):
        restored.apply_batch("w", EventBatch(seq, 1.0, [BlockRemoved([5])]))
        assert restored.holds(("w", 0), h)
    restored.apply_batch("w", EventBatch(99, 1.0, [BlockRemoved([5])]))
    assert not restored.holds(("w", 0), h)  # gone: a miss at worst, never pinned


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("router_hashes", [], "engine hashes"),  # columns of different lengths (zip cut them)
        ("tiers", [1 << 15] * 4, "tier mask"),  # a tier the snapshot does not name
        ("dups", [[123456, 0, 1]], "duplicate stores of a block not held"),
        ("dp_rank", 1 << 20, "cannot read"),
        ("seq", -1, "cannot read"),
        ("engine_hashes", [1, 1, 2, 3], "listed twice"),
    ],
)
def test_a_field_out_of_range_is_refused(field: str, value: object, error: str) -> None:
    obj = msgspec.msgpack.decode(BASE)
    obj["workers"][0][field] = value
    with pytest.raises(SnapshotError, match=error):
        PrefixIndex.from_snapshot_bytes(msgspec.msgpack.encode(obj))


def test_the_budget_counts_entries_before_decoding_and_stops_on_time() -> None:
    ix, _ = PrefixIndex.from_snapshot_bytes(BASE)
    total = ix.entries() + sum(len(w.dups) for _, w in ix.items())
    n = len(msgspec.msgpack.decode(BASE)["workers"][2]["cover"])  # (the paged rank's covers)
    PrefixIndex.from_snapshot_bytes(BASE, DecodeBudget(total + n))
    with pytest.raises(SnapshotError, match=f"over its budget of {total + n - 1} entries"):
        PrefixIndex.from_snapshot_bytes(BASE, DecodeBudget(total + n - 1))
    with pytest.raises(SnapshotError, match="ran past its deadline"):
        PrefixIndex.from_snapshot_bytes(BASE, DecodeBudget(deadline=time.monotonic() - 1))
    cancelled = DecodeBudget()
    cancelled.cancel()
    with pytest.raises(SnapshotError, match="decode cancelled"):
        PrefixIndex.from_snapshot_bytes(BASE, cancelled)
