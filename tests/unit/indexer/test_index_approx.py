"""The approximate tree of a rank without KV events (issue 36): the router's own block hashes of
what it sent there, matched like event-fed entries, bounded by the rank's GPU capacity (else
the default per rank) least recently sent first, a prefix forgotten from its tail."""

from __future__ import annotations

import random

from indexer.events import BlockStored
from indexer.index import PrefixIndex

BS = 4
APPROX, EVENTS = ("a", 0), ("e", 0)


def tokens(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(blocks * BS)]


def new_index(default_cap: int = 0) -> PrefixIndex:
    index = PrefixIndex(BS)
    index.set_rank_caps(default_cap, margin=1.25)
    index.add_worker(*APPROX)
    index.set_approximate(APPROX)
    index.add_worker(*EVENTS)
    return index


def test_what_was_sent_matches_on_the_same_scale_as_events() -> None:
    index = new_index()
    rng = random.Random(1)
    prompt = tokens(rng, 6)
    hashes = index.request_hashes(prompt)
    assert index.record_sent(APPROX, hashes[:4]) == 4
    # the event-fed rank stores the same prompt's first 4 blocks through its events
    index.apply_event(EVENTS, BlockStored([1, 2, 3, 4], None, prompt[: 4 * BS], BS))
    res = index.match(hashes)
    assert res.workers[APPROX].matched_blocks == 4
    assert res.workers[APPROX].by_tier == res.workers[EVENTS].by_tier == {"GPU": 4}
    stats = index.worker_stats(APPROX)
    assert (stats.source, index.worker_stats(EVENTS).source) == ("approximate", "events")
    assert stats.blocks_by_tier["GPU"] == 4
    # sent again: renewed, nothing new
    assert index.record_sent(APPROX, hashes[:4]) == 0
    assert index.entries() == 8


def test_a_rank_fed_by_events_ignores_sends() -> None:
    index = new_index()
    hashes = index.request_hashes(tokens(random.Random(2), 3))
    assert index.record_sent(EVENTS, hashes) == 0
    assert index.record_sent(("gone", 0), hashes) == 0
    assert index.match(hashes).workers[EVENTS].matched_blocks == 0


def test_past_its_gpu_capacity_the_least_recently_sent_prefix_goes_from_its_tail() -> None:
    index = new_index(default_cap=1000)
    assert index.set_rank_capacity(APPROX, {"GPU": 8, "CPU_PINNED": 100})
    assert index.rank_cap(APPROX) == (8, "capacity")  # its GPU blocks, no margin
    rng = random.Random(3)
    old, hot, new = (index.request_hashes(tokens(rng, 4)) for _ in range(3))
    index.record_sent(APPROX, old)
    index.record_sent(APPROX, hot)
    index.record_sent(APPROX, old[:2])  # old's first half is used again
    index.record_sent(APPROX, new)  # 12 entries for 8: the least recently sent 4 go
    res = index.match(old + hot + new)
    assert index.worker(APPROX).entries() == 8
    assert index.worker_stats(APPROX).forgotten_entries == 4
    # the least recently sent went, each prefix from its tail: old's renewed head and hot's
    # head stay
    assert [len(index.block_tiers(APPROX, h)) for h in (old, hot, new)] == [2, 2, 4]
    assert res.workers[APPROX].matched_blocks == 2
    assert index.worker_stats(APPROX).rank_evicted_entries == 0  # forgetting is no misbehaviour


def test_without_a_capacity_the_default_cap_bounds_it_and_a_capacity_trims_at_once() -> None:
    index = new_index(default_cap=6)
    rng = random.Random(4)
    for _ in range(3):
        index.record_sent(APPROX, index.request_hashes(tokens(rng, 3)))
    assert index.rank_cap(APPROX) == (6, "default")
    assert index.worker(APPROX).entries() == 6
    index.set_rank_capacity(APPROX, {"GPU": 2})
    assert index.worker(APPROX).entries() == 2
    assert index.worker_stats(APPROX).forgotten_entries == 7


def test_changing_kind_drops_the_other_kinds_entries() -> None:
    index = new_index()
    prompt = tokens(random.Random(5), 2)
    index.apply_event(EVENTS, BlockStored([1, 2], None, prompt, BS))
    index.set_approximate(EVENTS)
    assert index.approximate(EVENTS)
    assert index.worker(EVENTS).entries() == 0
    hashes = index.request_hashes(prompt)
    index.record_sent(EVENTS, hashes)
    index.set_approximate(EVENTS, False)
    assert not index.approximate(EVENTS)
    assert index.match(hashes).workers[EVENTS].matched_blocks == 0
    assert len(index) == 0


def test_turning_approximate_with_keep_seeds_the_tree_from_the_events() -> None:
    # a rank whose events lost stores: what they did say stays, what was sent since joins it
    index = new_index()
    rng = random.Random(6)
    kept, lost = tokens(rng, 3), tokens(rng, 2)
    index.apply_event(EVENTS, BlockStored([1, 2, 3], None, kept, BS))
    index.set_approximate(EVENTS, True, True)
    assert index.approximate(EVENTS)
    held = index.request_hashes(kept)
    assert index.match(held).workers[EVENTS].matched_blocks == 3
    assert index.worker(EVENTS).entries() == 3
    sent = index.request_hashes(lost)
    assert index.record_sent(EVENTS, sent) == 2
    assert index.match(sent).workers[EVENTS].matched_blocks == 2
    # its events are not applied while approximate; without keep, nothing would have stayed
    index.apply_event(EVENTS, BlockStored([9], None, tokens(rng, 1), BS))
    assert index.worker(EVENTS).entries() == 5
    index.set_approximate(EVENTS, False)
    index.apply_event(EVENTS, BlockStored([1, 2, 3], None, kept, BS))
    index.set_approximate(EVENTS, True)
    assert index.match(held).workers[EVENTS].matched_blocks == 0


def test_the_seed_is_bounded_by_the_trees_cap_oldest_stores_first() -> None:
    index = new_index()
    index.set_rank_capacity(EVENTS, {"GPU": 2})
    rng = random.Random(7)
    old, new = tokens(rng, 1), tokens(rng, 2)
    index.apply_event(EVENTS, BlockStored([1], None, old, BS))
    index.apply_event(EVENTS, BlockStored([2, 3], None, new, BS))
    index.set_approximate(EVENTS, True, True)
    assert index.worker(EVENTS).entries() == 2
    assert index.match(index.request_hashes(new)).workers[EVENTS].matched_blocks == 2
    assert index.match(index.request_hashes(old)).workers[EVENTS].matched_blocks == 0
