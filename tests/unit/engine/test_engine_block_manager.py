"""Block manager: chained hashes, prefix lookup, ref counts, LRU free queue with reverse-order free."""

from __future__ import annotations

import random

import pytest
from engine_helpers import BS, prompt

from engine.block_manager import BlockManager, NoFreeBlocksError, engine_block_hash
from engine.kv_events import EventLog
from engine.sequence import Request, Sequence
from indexer.events import BlockRemoved, BlockStored


def _bm(n: int = 8) -> BlockManager:
    return BlockManager(n, BS, EventLog(BS), seed=12345)


def _computed_seq(bm: BlockManager, tokens: list[int], seq_id: int = 0) -> Sequence:
    """A sequence whose whole prompt was computed into freshly allocated blocks."""
    seq = Sequence(Request(f"r{seq_id}", tokens, max_tokens=1), seq_id=seq_id, arrival=0.0)
    bm.hash_blocks(seq)
    hit = bm.lookup(seq.block_hashes)
    bm.touch(hit)
    seq.block_table = hit + bm.allocate(-(-len(tokens) // BS) - len(hit))
    seq.num_registered_blocks = len(hit)
    seq.num_computed_tokens = len(tokens)
    bm.register_computed(seq)
    return seq


def test_hashes_chain_over_the_prefix() -> None:
    bm = _bm()
    a = prompt(random.Random(1), 3 * BS)
    b = a[:BS] + prompt(random.Random(2), 2 * BS)
    ha, hb = bm.hash_blocks_of(a), bm.hash_blocks_of(b)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert ha[1] == engine_block_hash(ha[0], a[BS : 2 * BS])
    # same tokens at a different position (other parent) hash differently
    assert bm.hash_blocks_of(a[BS : 2 * BS])[0] != ha[1]
    assert len(bm.hash_blocks_of([*a, 1, 2, 3])) == 3  # only full blocks
    assert all(0 <= h < 2**64 for h in ha)


def test_register_publishes_once_per_hash_and_lookup_finds_the_prefix() -> None:
    bm = _bm()
    a = prompt(random.Random(1), 2 * BS + 3)
    s1 = _computed_seq(bm, a, 1)
    ev = bm.events.drain()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored)
    assert ev[0].block_hashes == s1.block_hashes[:2] and ev[0].parent_block_hash is None
    assert ev[0].token_ids == a[: 2 * BS] and ev[0].tier == "GPU"
    assert bm.lookup(s1.block_hashes) == s1.block_table[:2]
    # a second sequence with the same prompt reuses the blocks: no new event, shared refs
    s2 = _computed_seq(bm, a, 2)
    assert s2.block_table[:2] == s1.block_table[:2]
    assert [bm.blocks[b].ref_count for b in s1.block_table[:2]] == [2, 2]
    assert bm.events.drain() == []


def test_a_duplicate_computed_block_stays_private() -> None:
    bm = _bm()
    a = prompt(random.Random(1), 2 * BS)
    # two sequences computed the same prompt concurrently (no hit for the second either)
    s1 = Sequence(Request("1", a, 1), seq_id=1, arrival=0)
    s2 = Sequence(Request("2", a, 1), seq_id=2, arrival=0)
    for s in (s1, s2):
        s.block_table = bm.allocate(2)
        s.num_computed_tokens = 2 * BS
    for s in (s1, s2):
        bm.register_computed(s)
    stored = [e for e in bm.events.drain() if isinstance(e, BlockStored)]
    assert len(stored) == 1
    assert bm.lookup(s1.block_hashes) == s1.block_table
    bm.free_blocks(s2.block_table)
    assert bm.num_cached == 2  # freeing the private copies drops nothing cached


def test_free_in_reverse_order_evicts_the_tail_first_and_lru_across_sequences() -> None:
    bm = _bm(8)
    rng = random.Random(3)
    old = _computed_seq(bm, prompt(rng, 4 * BS), 1)
    new = _computed_seq(bm, prompt(rng, 4 * BS), 2)
    bm.free_blocks(old.block_table)
    bm.free_blocks(new.block_table)
    bm.events.drain()
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.allocate(6)
    removed = [e.block_hashes[0] for e in bm.events.drain() if isinstance(e, BlockRemoved)]
    # the older sequence goes first, each sequence tail before head
    h_old, h_new = old.block_hashes, new.block_hashes
    assert removed == [h_old[3], h_old[2], h_old[1], h_old[0], h_new[3], h_new[2]]
    assert bm.lookup(h_new) == new.block_table[:2]


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    bm = _bm(4)
    seq = _computed_seq(bm, prompt(random.Random(4), 2 * BS + 5), 1)  # 2 full + 1 partial
    bm.free_blocks(seq.block_table)
    bm.events.drain()
    assert bm.allocate(2)[0] == seq.block_table[2]  # the partial block, then a never-used one
    assert bm.events.drain() == []


def test_hits_take_blocks_out_of_the_free_queue_and_ref_counts_guard_frees() -> None:
    bm = _bm(4)
    a = prompt(random.Random(5), 2 * BS)
    s1 = _computed_seq(bm, a, 1)
    bm.free_blocks(s1.block_table)
    s2 = _computed_seq(bm, [*a, 65], 2)  # hits both blocks
    assert s2.block_table[:2] == s1.block_table
    assert bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    bm.free_blocks(s2.block_table)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.unpin(s2.block_table[0])


def test_reset_forgets_every_hash_but_keeps_blocks_in_use() -> None:
    bm = _bm(4)
    seq = _computed_seq(bm, prompt(random.Random(6), 2 * BS), 1)
    bm.reset()
    assert bm.num_cached == 0 and bm.lookup(seq.block_hashes) == []
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1]
    bm.free_blocks(seq.block_table)
    assert bm.num_free_blocks == 4


def test_event_log_publishes_only_canonical_tiers() -> None:
    log = EventLog(BS)
    with pytest.raises(ValueError, match="unknown tier"):
        log.stored("HBM", [1], None, list(range(BS)))
    with pytest.raises(ValueError, match="unknown tier"):
        log.removed("gpu", [1])
    assert len(log) == 0
