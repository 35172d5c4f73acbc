"""Pure scoring (DESIGN §5): credit per tier, the cost formula, sharing, ties, temperature."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.scoring import (
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

W = ScoreWeights()


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
    assert score(c, 16, ScoreWeights(overlap_weight=2.0)) == pytest.approx(42.0)
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


def test_rank_order_is_cost_load_then_tie_hash_then_index():
    """Ties are hashed only where they occur: the order must still be exactly
    (cost, load, tie_hash(request, worker), index) over the healthy candidates."""
    import random

    rng = random.Random(11)
    for _ in range(300):
        cands = [
            Candidate(
                (f"w{i}", rng.randrange(2)),
                healthy=rng.random() < 0.9,
                by_tier={"GPU": rng.choice([0, 4, 8])},
                active_blocks=rng.choice([0, 0, 3]),
            )
            for i in range(rng.randrange(0, 10))
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
