"""Pure scoring (docs/architecture.md §5): credit per tier, the cost formula, sharing, ties, temperature."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.placement.scoring import (
    Candidate,
    ScoreWeights,
    ScrapedLoad,
    credited_blocks,
    rank,
    score,
    tie_hash,
    tier_breakdown,
    worker_hash,
)

W = ScoreWeights(
    overlap_weight=1.0, cache_credit=1.0
)  # the formula at unit weights; defaults are tuned


def test_credit_uses_tier_weights_and_unknown_tiers_as_external():
    assert credited_blocks({"GPU": 10}, 0, W) == 10.0
    assert credited_blocks({"CPU_PINNED": 10, "DISK": 10}, 0, W) == pytest.approx(13.0)
    assert credited_blocks({"EXTERNAL": 10}, 0, W) == pytest.approx(3.0)
    assert credited_blocks({"TAPE": 10}, 0, W) == pytest.approx(3.0)  # never like GPU
    assert credited_blocks({"GPU": 2}, 5, W) == 7.0  # predicted blocks count like GPU
    custom = ScoreWeights(tier_weights={"GPU": 1.0, "EXTERNAL": 0.1})
    assert credited_blocks({"MYSTERY": 10}, 0, custom) == pytest.approx(1.0)


def test_cost_formula():
    c = Candidate(("a", 0), by_tier={"GPU": 6, "DISK": 4}, inflight_prefill=3.0, active_blocks=20)
    # ow · (inflight + n − credit) + active = 2 · (3 + 16 − 8) + 20
    assert score(c, 16, ScoreWeights(overlap_weight=2.0, cache_credit=1.0)) == pytest.approx(42.0)
    # with a cache credit of 3 and another worker crediting 12: 2 · (3 + 16 − 8 + 2 · (12 − 8)) + 20
    w3 = ScoreWeights(overlap_weight=2.0, cache_credit=3.0)
    assert score(c, 16, w3, best_credit=12.0) == pytest.approx(58.0)
    assert score(c, 16, w3, best_credit=8.0) == pytest.approx(42.0)  # the best pays no penalty
    assert c.credited == pytest.approx(8.0)
    assert c.credited == pytest.approx(8.0)


def test_shared_blocks_are_not_charged_twice():
    # 100 of the request's blocks are being prefilled by a request already on this worker
    c = Candidate(
        ("a", 0),
        predicted_blocks=100,
        inflight_prefill=101.0,
        active_blocks=102,
        shared_active=100,
        shared_prefill=100,
    )
    assert score(c, 101, W) == pytest.approx((1 + 101 - 100) + 2)
    idle = Candidate(("b", 0))
    assert score(idle, 101, W) == 101.0


def test_blocks_that_do_not_fit_beside_the_running_ones_cost_prefill():
    # 100 blocks of KV, 90 held by running requests (5 of them this request's prefix): a request
    # of 20 blocks holds all 20 while it runs, 15 more than the 85 others leave room for: 5 over
    c = Candidate(("a", 0), by_tier={"GPU": 5}, active_blocks=90, shared_active=5, capacity=100)
    w = ScoreWeights(overlap_weight=2.0, cache_credit=1.0, overflow_weight=3.0)
    # ow · (0 + 20 − 5 + 3 · 5) + (90 − 5)
    assert score(c, 20, w) == pytest.approx(2 * (15 + 15) + 85)
    roomy = Candidate(("b", 0), by_tier={"GPU": 5}, active_blocks=90, shared_active=5, capacity=105)
    assert score(roomy, 20, w) == pytest.approx(2 * 15 + 85)  # it fits: nothing more
    unknown = Candidate(("c", 0), by_tier={"GPU": 5}, active_blocks=90, shared_active=5)
    assert score(unknown, 20, w) == pytest.approx(2 * 15 + 85)  # capacity not known: off
    off = ScoreWeights(overlap_weight=2.0, cache_credit=1.0, overflow_weight=0.0)
    assert score(c, 20, off) == pytest.approx(2 * 15 + 85)


def test_a_full_worker_loses_to_one_with_room_at_equal_load():
    # same queued prefill and held blocks; one has twice the KV: the request fits only there
    small = Candidate(("small", 0), inflight_prefill=4.0, active_blocks=60, capacity=64)
    large = Candidate(("large", 0), inflight_prefill=4.0, active_blocks=60, capacity=128)
    cands = [small, large]
    assert [cands[i].key[0] for i in rank(cands, 16, ScoreWeights())] == ["large", "small"]
    assert small.cost - large.cost == pytest.approx(ScoreWeights().overlap_weight * 12)


def test_scraped_load_blend():
    c = Candidate(("a", 0), scraped=ScrapedLoad(running=3, waiting=2, kv_usage=0.5))
    w = ScoreWeights(running_weight=1.0, waiting_weight=4.0, kv_usage_weight=10.0)
    assert score(c, 0, w) == pytest.approx(3 + 8 + 5)
    assert score(c, 0, W) == 0.0  # weights default to 0: scraped load ignored


def test_rank_orders_by_cost_and_skips_unhealthy():
    cands = [
        Candidate(("a", 0), by_tier={"GPU": 8}),
        Candidate(("b", 0)),
        Candidate(("c", 0), healthy=False, by_tier={"GPU": 16}),
        Candidate(("d", 0), by_tier={"CPU_PINNED": 16}),  # cost 3.2 beats 8 on GPU
    ]
    order = rank(cands, 16, W)
    assert [cands[i].key[0] for i in order] == ["d", "a", "b"]
    assert cands[2].cost == 0.0  # still scored, reported, never chosen
    assert rank([Candidate(("x", 0), healthy=False)], 4, W) == []


def test_ties_break_on_load_then_a_stable_request_hash():
    a = Candidate(("a", 0), by_tier={"GPU": 4}, active_blocks=4)  # cost 4, load 4
    b = Candidate(("b", 0), inflight_prefill=0.0, active_blocks=0, by_tier={})  # cost 4, load 0
    assert [x for x in rank([a, b], 4, W)] == [1, 0]
    # equal cost and load: the request hash decides, the same way every time
    firsts = Counter()
    for key in range(200):
        cs = [Candidate((f"w{i}", 0)) for i in range(4)]
        o1 = rank(cs, 8, W, request_key=key)
        o2 = rank([Candidate((f"w{i}", 0)) for i in range(4)], 8, W, request_key=key)
        assert o1 == o2
        firsts[o1[0]] += 1
    assert len(firsts) == 4  # different requests spread over equal workers
    wa = worker_hash(("a", 0))
    assert wa == worker_hash(("a", 0)) != worker_hash(("a", 1))
    assert tie_hash(1, wa) == tie_hash(1, wa) != tie_hash(2, wa)


def test_temperature_samples_cheaper_workers_more_often():
    rng = random.Random(1)
    counts = Counter()
    for _ in range(2000):
        cs = [Candidate(("cheap", 0), by_tier={"GPU": 10}), Candidate(("dear", 0))]
        counts[cs[rank(cs, 10, W, temperature=0.5, rng=rng)[0]].key[0]] += 1
    # normalized costs 0 and 1: p(dear) = 1 / (1 + e^2) ≈ 0.12
    assert 0.08 < counts["dear"] / 2000 < 0.16
    cs = [Candidate(("cheap", 0), by_tier={"GPU": 10}), Candidate(("dear", 0))]
    assert rank(cs, 10, W, temperature=0.0) == [0, 1]


def test_tier_breakdown_lists_canonical_tiers_first():
    assert tier_breakdown({"DISK": 3, "TAPE": 1}) == {
        "GPU": 0,
        "CPU_PINNED": 0,
        "DISK": 3,
        "EXTERNAL": 0,
        "TAPE": 1,
    }


@pytest.mark.parametrize("whash", ["given", "computed"])
def test_rank_order_is_cost_load_then_tie_hash_then_index(whash: str):
    """Ties are hashed only where they occur: the order must still be exactly
    (cost, load, tie_hash(request, worker), index) over the healthy candidates, whether the
    worker hash is given (as the router does) or computed."""
    rng = random.Random(11)
    for _ in range(300):
        cands = [
            Candidate(
                (f"w{i}", r),
                healthy=rng.random() < 0.9,
                by_tier={"GPU": rng.choice([0, 4, 8])},
                active_blocks=rng.choice([0, 0, 3]),
                whash=worker_hash((f"w{i}", r)) if whash == "given" else -1,
            )
            for i, r in ((i, rng.randrange(2)) for i in range(rng.randrange(0, 10)))
        ]
        key = rng.getrandbits(64)
        order = rank(cands, 8, W, request_key=key)
        expected = sorted(
            (i for i, c in enumerate(cands) if c.healthy),
            key=lambda i: (
                cands[i].cost,
                cands[i].inflight_prefill + cands[i].active_blocks,
                tie_hash(key, worker_hash(cands[i].key)),
                i,
            ),
        )
        assert order == expected


def test_cache_credit_keeps_a_request_on_its_cache_against_a_queue():
    """A follow-up turn: 100 of its 110 blocks cached on w0, which has 300 blocks of prefill
    queued; w1 is idle. At credit 1 the myopic TTFT wins (w1: 110 blocks to prefill < w0: 310);
    at the default 8 a reused block outweighs eight queued ones and the request stays."""
    held = Candidate(("w0", 0), by_tier={"GPU": 100}, inflight_prefill=300.0, whash=1)
    idle = Candidate(("w1", 0), whash=2)
    assert rank([held, idle], 110, ScoreWeights(cache_credit=1.0)) == [1, 0]
    assert rank([held, idle], 110, ScoreWeights()) == [0, 1]
    assert held.credited == 100.0  # the credit reported is blocks reused, never the multiplier
    assert held.cost == pytest.approx(16.0 * (300 + 110 - 100))  # the holder: no penalty
    assert idle.cost == pytest.approx(16.0 * (110 + 7 * 100))  # 8 prefill blocks per one it lacks


def test_a_replica_lane_takes_its_near_best_worker_first():
    w = ScoreWeights(overlap_weight=1.0, cache_credit=1.0, replica_spread=0.5)

    def cands() -> list[Candidate]:
        # n = 8, nothing cached: own prefill 8, so "near" is within 0.5 x 8 = 4 of the best
        return [
            Candidate(("a", 0), active_blocks=0),  # 8
            Candidate(("b", 0), active_blocks=1),  # 9
            Candidate(("c", 0), active_blocks=3),  # 11
            Candidate(("d", 0), active_blocks=40),  # 48: never near
        ]

    keys = lambda cs, o: [cs[i].key[0] for i in o]  # noqa: E731
    cs = cands()
    assert keys(cs, rank(cs, 8, w)) == ["a", "b", "c", "d"]
    assert keys(cs, rank(cs, 8, w, lane=(0, 4))) == ["a", "b", "c", "d"]  # lane 0: the best
    assert keys(cs, rank(cs, 8, w, lane=(1, 4))) == ["b", "a", "c", "d"]
    assert keys(cs, rank(cs, 8, w, lane=(2, 4))) == ["c", "a", "b", "d"]
    assert keys(cs, rank(cs, 8, w, lane=(3, 4))) == ["a", "b", "c", "d"]  # 3 mod 3 near
    off = ScoreWeights(overlap_weight=1.0, cache_credit=1.0, replica_spread=0.0)
    assert keys(cs, rank(cs, 8, off, lane=(1, 4))) == ["a", "b", "c", "d"]
    # a cached prefix is worth more than the spread: every lane keeps it
    cached = [Candidate(("a", 0), by_tier={"GPU": 6}), Candidate(("b", 0))]
    for lane in range(4):
        assert rank(cached, 8, w, lane=(lane, 4))[0] == 0
