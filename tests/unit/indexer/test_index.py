"""PrefixIndex: stores, per-tier removals, clears, matches, pools, overlays, snapshots, and a
Hypothesis state machine against a naive reference model."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored
from indexer.events import EventBatch as Batch
from indexer.index import SGLANG_ROOT_PARENT, PrefixIndex, SnapshotError

A, B = ("a", 0), ("b", 0)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_store_match_and_tiers() -> None:
    idx = PrefixIndex(4)
    idx.add_worker("a")
    idx.add_worker("b")
    t = tokens(16)
    idx.apply_event(A, BlockStored([1, 2, 3, 4], None, t, 4, "GPU"))
    idx.apply_event(B, BlockStored([11, 12], None, t[:8], 4, "CPU_PINNED"))
    res = idx.match(idx.request_hashes(t))
    assert res.request_blocks == 4
    assert res.workers[A].matched_blocks == 4
    assert res.workers[A].by_tier == {"GPU": 4}
    assert res.workers[B].matched_blocks == 2
    assert res.workers[B].by_tier["CPU_PINNED"] == 2
    assert res.workers[B].by_tier.get("GPU", 0) == 0


def test_partial_blocks_do_not_count_and_other_namespace_misses() -> None:
    idx = PrefixIndex(4)
    t = tokens(10)
    idx.apply_event(A, BlockStored([1, 2], None, t[:8], 4, "GPU"))
    assert idx.match(idx.request_hashes(t)).workers[A].matched_blocks == 2
    assert idx.match(idx.request_hashes(t, model="other")).workers[A].matched_blocks == 0
    assert idx.match(idx.request_hashes(t, lora_name="x")).workers[A].matched_blocks == 0


def test_remove_only_named_tier_and_block_leaves_when_no_tier_holds_it() -> None:
    idx = PrefixIndex(4)
    t = tokens(8)
    idx.apply_event(A, BlockStored([1, 2], None, t, 4, "GPU"))
    idx.apply_event(A, BlockStored([1, 2], None, t, 4, "CPU_PINNED"))
    h = idx.request_hashes(t)
    assert idx.block_tiers(A, h) == [frozenset({"GPU", "CPU_PINNED"})] * 2
    idx.apply_event(A, BlockRemoved([1, 2], "GPU"))
    m = idx.match(h).workers[A]
    assert (m.matched_blocks, m.by_tier) == (2, {"GPU": 0, "CPU_PINNED": 2})
    idx.apply_event(A, BlockRemoved([1], "CPU_PINNED"))
    assert idx.match(h).workers[A].matched_blocks == 0
    assert len(idx) == 1  # block 2 is still held, out of prefix order
    idx.apply_event(A, BlockRemoved([2], "CPU_PINNED"))
    assert len(idx) == 0
    assert idx.entries() == 0


def test_fastest_tier_counts_and_unknown_medium_kept_by_name() -> None:
    idx = PrefixIndex(4)
    t = tokens(12)
    idx.apply_event(A, BlockStored([1], None, t[:4], 4, "DISK"))
    idx.apply_event(A, BlockStored([1], None, t[:4], 4, "CPU_PINNED"))
    idx.apply_event(A, BlockStored([2], 1, t[4:8], 4, "EXTERNAL"))
    idx.apply_event(A, BlockStored([3], 2, t[8:12], 4, "WEIRD_TIER"))
    m = idx.match(idx.request_hashes(t)).workers[A]
    assert m.matched_blocks == 3
    assert m.by_tier == {"GPU": 0, "CPU_PINNED": 1, "EXTERNAL": 1, "WEIRD_TIER": 1}
    assert idx.unknown_tiers == {"WEIRD_TIER": 1}


def test_orphan_dropped_and_counted_and_sglang_root_parent() -> None:
    idx = PrefixIndex(4)
    t = tokens(8)
    idx.apply_event(A, BlockStored([7], 999, t[:4], 4, "GPU"))
    assert idx.worker_stats(A).orphans == 1
    assert idx.entries() == 0
    idx.apply_event(A, BlockStored([7], SGLANG_ROOT_PARENT, t[:4], 4, "GPU"))
    assert idx.match(idx.request_hashes(t)).workers[A].matched_blocks == 1


def test_clear_remove_and_dp_ranks_are_separate() -> None:
    idx = PrefixIndex(4)
    t = tokens(8)
    idx.apply_batch("a", Batch(0, 0.0, [BlockStored([1, 2], None, t, 4)], dp_rank=0))
    idx.apply_batch("a", Batch(0, 0.0, [BlockStored([1, 2], None, t, 4)], dp_rank=1))
    idx.apply_event(B, BlockStored([5, 6], None, t, 4))
    h = idx.request_hashes(t)
    idx.apply_batch("a", Batch(1, 0.0, [AllBlocksCleared()], dp_rank=0))
    res = idx.match(h).workers
    assert (res[("a", 0)].matched_blocks, res[("a", 1)].matched_blocks, res[B].matched_blocks) == (
        0,
        2,
        2,
    )
    idx.remove_worker("a")
    assert set(idx.match(h).workers) == {B}
    idx.add_worker("c")  # reuses a freed slot: must not inherit anything
    assert idx.match(h).workers[("c", 0)].matched_blocks == 0


def test_pools_credit_external_and_overlay_counts_predicted() -> None:
    idx = PrefixIndex(4)
    t = tokens(12)
    idx.apply_event(A, BlockStored([1], None, t[:4], 4, "GPU"))
    idx.apply_event(B, BlockStored([11, 12], None, t[:8], 4, "EXTERNAL"))
    h = idx.request_hashes(t)
    assert idx.match(h).workers[A].matched_blocks == 1
    m = idx.match(h, pools=[[A, B]]).workers[A]
    assert (m.matched_blocks, m.by_tier) == (2, {"GPU": 1, "EXTERNAL": 1})
    m = idx.match(h, overlay={h[1]: 1 << idx.slot(A), h[2]: 1 << idx.slot(A)}).workers[A]
    assert (m.matched_blocks, m.predicted_blocks, m.by_tier["GPU"]) == (3, 2, 1)


@settings(max_examples=150, deadline=None)
@given(
    held=st.lists(st.integers(0, 12), min_size=4, max_size=4),
    gaps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 11)), max_size=3),
    predicted=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 15)), max_size=12),
)
def test_overlay_walk_agrees_with_general_walk(
    held: list[int], gaps: list[tuple[int, int]], predicted: list[tuple[int, int]]
) -> None:
    """The per-run overlay walk (GPU-only holders + predictions) answers exactly like the
    general per-block path, for prefixes with holes and predictions anywhere."""
    idx = PrefixIndex(2)
    t = tokens(24)
    h = idx.request_hashes(t)
    keys = [(f"w{i}", 0) for i in range(4)]
    for key, n in zip(keys, held):
        idx.add_worker(key[0])
        if n:
            idx.apply_event(key, BlockStored(list(range(100, 100 + n)), None, t[: 2 * n], 2))
    for w, b in gaps:  # holes in a worker's prefix
        if b < held[w]:
            idx.apply_event(keys[w], BlockRemoved([100 + b]))
    overlay: dict[int, int] = {}
    for b, mask in predicted:
        overlay[h[b]] = overlay.get(h[b], 0) | mask
    general = idx._matcher._match_general(h, overlay, ())
    # per run in Python, and match()'s own path (the C walk with the overlay, where built)
    for fast in (idx._matcher._match_overlay(h, overlay), idx.match(h, overlay=overlay)):
        assert fast.request_blocks == general.request_blocks
        for key in keys:
            f, g = fast.workers[key], general.workers[key]
            assert (f.matched_blocks, f.predicted_blocks, dict(f.by_tier)) == (
                g.matched_blocks,
                g.predicted_blocks,
                dict(g.by_tier),
            ), key


def test_same_tokens_under_two_engine_hashes() -> None:
    idx = PrefixIndex(4)
    t = tokens(4)
    h = idx.request_hashes(t)
    idx.apply_event(A, BlockStored([1], None, t, 4, "GPU"))
    idx.apply_event(A, BlockStored([2], None, t, 4, "DISK"))  # e.g. another cache salt
    idx.apply_event(A, BlockRemoved([1], "GPU"))
    assert idx.match(h).workers[A].by_tier == {"GPU": 0, "DISK": 1}
    idx.apply_event(A, BlockRemoved([2], "DISK"))
    assert idx.match(h).workers[A].matched_blocks == 0


@pytest.mark.parametrize("router_bs", [16, 64])
@pytest.mark.parametrize("page", [1, 16, 32, 64])
def test_rechunk_page_sizes(page: int, router_bs: int) -> None:
    idx = PrefixIndex(router_bs)
    t = tokens(256, start=1000)
    n_pages = len(t) // page
    # one event per page, as SGLang sends them; engine hashes are opaque ids
    for i in range(n_pages):
        parent = None if i == 0 else 100 + i - 1
        idx.apply_event(A, BlockStored([100 + i], parent, t[i * page : (i + 1) * page], page))
    h = idx.request_hashes(t)
    assert len(h) == 256 // router_bs
    assert idx.match(h).workers[A].matched_blocks == len(h)
    # the same chain through the normal path agrees with the re-chunked one
    ref = PrefixIndex(router_bs)
    ref.apply_event(A, BlockStored(list(range(len(h))), None, t, router_bs))
    assert ref.request_hashes(t) == h
    assert ref.match(h).workers[A].matched_blocks == len(h)
    # evicting the page holding token 40 to CPU makes the covering router block CPU-tier
    victim = 100 + 40 // page
    idx.apply_event(A, BlockStored([victim], None, [], page, "CPU_PINNED"))
    idx.apply_event(A, BlockRemoved([victim], "GPU"))
    m = idx.match(h).workers[A]
    covered = {(40 // page * page + k) // router_bs for k in range(page)}
    assert m.matched_blocks == len(h)
    assert m.by_tier["CPU_PINNED"] == len(covered)
    # dropping it entirely ends the match at the first router block it covers
    idx.apply_event(A, BlockRemoved([victim], "CPU_PINNED"))
    assert idx.match(h).workers[A].matched_blocks == min(covered)
    # and storing it again brings everything back
    idx.apply_event(
        A,
        BlockStored(
            [victim],
            None if victim == 100 else victim - 1,
            t[(victim - 100) * page : (victim - 99) * page],
            page,
        ),
    )
    assert idx.match(h).workers[A].matched_blocks == len(h)
    assert idx.match(h).workers[A].by_tier == {"GPU": len(h)}


def test_snapshot_restore_answers_like_original(tmp_path: Path) -> None:
    idx = PrefixIndex(4)
    t = tokens(16)
    idx.apply_event(A, BlockStored([1, 2, 3], None, t[:12], 4, "GPU"))
    idx.apply_event(A, BlockStored([1, 2], None, t[:8], 4, "DISK"))
    idx.apply_event(A, BlockRemoved([1], "GPU"))
    idx.apply_event(B, BlockStored([b"x" * 32], None, t[:4], 4, "CPU"))
    idx.apply_event(("c", 1), BlockStored([5, 6], None, t[:2], 1, "GPU"))  # re-chunked
    idx.apply_event(("c", 1), BlockStored([7, 8], 6, t[2:4], 1, "GPU"))
    path = tmp_path / "snap.msgpack"
    idx.snapshot(path, {A: 41, B: 7})
    restored, seqs = PrefixIndex.restore(path)
    assert seqs == {A: 41, B: 7}
    for n in range(0, 17, 4):
        h = idx.request_hashes(t[:n])
        assert restored.match(h) == idx.match(h)
    assert restored.engine_blocks(A) == idx.engine_blocks(A)
    # and it keeps applying events like the original
    for x in (idx, restored):
        x.apply_event(A, BlockStored([4], 3, t[12:16], 4, "GPU"))
        x.apply_event(A, BlockRemoved([2], "DISK"))
    h = idx.request_hashes(t)
    assert restored.match(h) == idx.match(h)


def test_a_snapshot_taken_a_rank_at_a_time_keeps_each_rank_with_its_own_seq() -> None:
    idx = PrefixIndex(4)
    t = tokens(12)
    for key in (A, B, ("gone", 0)):
        idx.apply_event(key, BlockStored([1], None, t[:4], 4))
    builder = idx.snapshot_builder()
    assert builder.ranks() == [A, B, ("gone", 0)]
    builder.add(A, 3)
    # between two ranks the index moves on: A's later store is not in the file (its seq 3 is
    # from before it: a resume replays it), B's is, with the seq read beside it
    idx.apply_event(A, BlockStored([2], 1, t[4:8], 4))
    idx.apply_event(B, BlockStored([2], 1, t[4:8], 4))
    idx.add_worker("late")  # came after the ranks were listed: the next snapshot has it
    idx.remove_worker("gone")  # went before its turn: left out
    builder.add(B, 4)
    builder.add(("gone", 0), 9)
    restored, seqs = PrefixIndex.from_snapshot_bytes(builder.finish()())
    assert seqs == {A: 3, B: 4}
    assert restored.workers() == [A, B]
    h = idx.request_hashes(t[:8])
    assert restored.match(h).workers[A].matched_blocks == 1
    assert restored.match(h).workers[B].matched_blocks == 2


def test_snapshot_rejects_garbage(tmp_path: Path) -> None:
    p = tmp_path / "bad"
    p.write_bytes(b"\x93not a snapshot")
    with pytest.raises(SnapshotError, match="cannot read index snapshot"):
        PrefixIndex.restore(p)


# --------------------------------------------------------------------------- reference model

BS = 2
CONTENTS = [[1, 2], [3, 4], [1, 2, 3, 4][1:3]]  # three distinct 2-token blocks
WORKERS = [("w0", 0), ("w1", 0), ("w2", 0)]
TIERS = ["GPU", "CPU_PINNED"]
QUERIES = [
    list(itertools.chain.from_iterable(CONTENTS[i] for i in q))
    for q in itertools.product(range(3), repeat=3)
]


class IndexMachine(RuleBasedStateMachine):
    """Random stores/removes/clears/worker removals across 3 workers and 2 tiers."""

    @initialize()
    def setup(self) -> None:
        self.idx = PrefixIndex(BS)
        # worker -> engine hash -> [token prefix tuple, {tier: stores}] (a store counts: one
        # removal per store, issue 12)
        self.ref: dict[tuple[str, int], dict[int, list]] = {w: {} for w in WORKERS}
        for w in WORKERS:
            self.idx.add_worker(*w)
        self.next_hash = 1

    @rule(
        w=st.sampled_from(WORKERS),
        parent_pick=st.integers(0, 50),
        from_root=st.booleans(),
        blocks=st.lists(st.integers(0, 2), min_size=1, max_size=3),
        tier=st.sampled_from(TIERS),
        reuse=st.booleans(),
    )
    def store(self, w, parent_pick, from_root, blocks, tier, reuse) -> None:
        table = self.ref[w]
        parent = None
        prefix: tuple[int, ...] = ()
        if table and not from_root:
            parent = sorted(table)[parent_pick % len(table)]
            prefix = table[parent][0]
        if len(prefix) // BS + len(blocks) > 4:
            return
        toks = [t for b in blocks for t in CONTENTS[b]]
        hashes = []
        for i in range(len(blocks)):
            pre = prefix + tuple(toks[: (i + 1) * BS])
            # reuse an engine hash of this worker for the same prefix (a re-store / lower-tier
            # copy), or mint a new one (same tokens under another engine hash)
            same = [e for e, (p, _) in table.items() if p == pre] if reuse else []
            if same:
                hashes.append(same[0])
            else:
                hashes.append(self.next_hash)
                self.next_hash += 1
        self.idx.apply_event(w, BlockStored(hashes, parent, toks, BS, tier))
        for i, e in enumerate(hashes):
            pre = prefix + tuple(toks[: (i + 1) * BS])
            tiers = table.setdefault(e, [pre, {}])[1]
            tiers[tier] = tiers.get(tier, 0) + 1

    @rule(w=st.sampled_from(WORKERS), pick=st.integers(0, 50), tier=st.sampled_from(TIERS))
    def remove(self, w, pick, tier) -> None:
        table = self.ref[w]
        if not table:
            return
        e = sorted(table)[pick % len(table)]
        self.idx.apply_event(w, BlockRemoved([e], tier))
        tiers = table[e][1]
        if tiers.get(tier, 0) > 1:
            tiers[tier] -= 1
        else:
            tiers.pop(tier, None)
        if not tiers:
            del table[e]

    @rule(w=st.sampled_from(WORKERS))
    def clear(self, w) -> None:
        self.idx.apply_event(w, AllBlocksCleared())
        self.ref[w] = {}

    @rule(w=st.sampled_from(WORKERS))
    def remove_and_readd_worker(self, w) -> None:
        self.idx.remove_worker(*w)
        self.idx.add_worker(*w)
        self.ref[w] = {}

    @invariant()
    def matches_agree(self) -> None:
        for q in QUERIES:
            res = self.idx.match(self.idx.request_hashes(q))
            for w in WORKERS:
                held: dict[tuple[int, ...], set[str]] = {}
                for pre, tiers in self.ref[w].values():
                    held.setdefault(pre, set()).update(tiers)
                matched, by_tier = 0, {}
                for k in range(1, len(q) // BS + 1):
                    tiers = held.get(tuple(q[: k * BS]))
                    if not tiers:
                        break
                    matched += 1
                    fastest = min(tiers, key=TIERS.index)
                    by_tier[fastest] = by_tier.get(fastest, 0) + 1
                got = res.workers[w]
                assert got.matched_blocks == matched, (w, q)
                assert {k: v for k, v in got.by_tier.items() if v} == by_tier, (w, q)


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestIndexMachine = IndexMachine.TestCase


class PyFallbackIndexMachine(IndexMachine):
    """The same model check with the pure-Python twins of the C hot paths."""

    @initialize()
    def setup(self) -> None:
        from indexer.index import apply, match, native

        # (and a plain dict for the present table, as where the extension is not built)
        self._saved = (apply._store_gpu, apply._remove_gpu, match._walk_lengths, native.MaskMap)
        apply._store_gpu, apply._remove_gpu, match._walk_lengths, native.MaskMap = (
            native._py_store_gpu,
            native._py_remove_gpu,
            native._py_walk_lengths,
            None,
        )
        super().setup()

    def teardown(self) -> None:
        from indexer.index import apply, match, native

        if hasattr(self, "_saved"):
            apply._store_gpu, apply._remove_gpu, match._walk_lengths, native.MaskMap = self._saved


PyFallbackIndexMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None
)
TestPyFallbackIndexMachine = PyFallbackIndexMachine.TestCase


def test_a_snapshot_cover_that_repeats_an_engine_block_is_refused() -> None:
    """Issue 37, 3: a re-chunked rank whose cover lists one engine block thousands of times
    made each tier change of it quadratic (27 s for 24 KB); such a cover is not a snapshot."""
    idx = PrefixIndex(4)
    t = tokens(16)
    idx.apply_event(A, BlockStored([1, 2], None, t, 8))  # pages of 8: re-chunked into blocks of 4
    builder = idx.snapshot_builder()
    builder.add(A, 1)
    good = builder.finish()()
    restored, _ = PrefixIndex.from_snapshot_bytes(good)  # the honest one loads
    assert restored.match(idx.request_hashes(t)).workers[A].matched_blocks == 4
    snap = msgspec.msgpack.decode(good)
    (rank,) = snap["workers"]
    assert rank["cover"]
    h, cov = rank["cover"][0]
    for bad in (cov * 5000, cov + cov[:1]):
        rank["cover"][0] = [h, bad]
        with pytest.raises(SnapshotError, match="covered by"):
            PrefixIndex.from_snapshot_bytes(msgspec.msgpack.encode(snap))
