"""Pure scoring (docs/architecture.md §5): credit per tier, the cost formula, sharing, ties, temperature."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

W = ScoreWeights(overlap_weight=1.0)  # the formula at unit weight; the default is tuned


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


@pytest.mark.parametrize("whash", ["given", "computed"])
def test_rank_order_is_cost_load_then_tie_hash_then_index(whash: str):
    """Ties are hashed only where they occur: the order must still be exactly
    (cost, load, tie_hash(request, worker), index) over the healthy candidates. With the worker
    hash given (as the router does) the C ranking runs, else the Python one."""
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


_NOT_BUILT = "router._score was not built (no C compiler at install?): the C ranking is untested"
_TIERS = st.sampled_from(["GPU", "CPU_PINNED", "DISK", "EXTERNAL", "TAPE"])
_COUNT = st.integers(0, 600)


@st.composite
def _candidates(draw: st.DrawFn) -> list[Candidate]:
    out = []
    for i in range(draw(st.integers(0, 12))):
        key = (f"w{i}", draw(st.integers(0, 2)))
        out.append(
            Candidate(
                key,
                healthy=draw(st.booleans()),
                matched_blocks=draw(_COUNT),
                by_tier=draw(st.dictionaries(_TIERS, _COUNT, max_size=4)),
                predicted_blocks=draw(_COUNT),
                inflight_prefill=draw(st.sampled_from([0.0, 3.5, 100.0, 1e9])),
                active_blocks=draw(_COUNT),
                shared_active=draw(_COUNT),
                shared_prefill=draw(_COUNT),
                scraped=draw(
                    st.none() | st.builds(ScrapedLoad, _FLOAT, _FLOAT, st.floats(0.0, 1.0))
                ),
                whash=worker_hash(key),
            )
        )
    return out


_FLOAT = st.floats(0.0, 1e6, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    cands=_candidates(),
    n=st.integers(0, 600),
    key=st.integers(0, 2**64 - 1),
    weights=st.builds(
        ScoreWeights,
        st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        st.dictionaries(_TIERS, st.floats(0.0, 2.0), max_size=5),
        _FLOAT,
        _FLOAT,
        _FLOAT,
    ),
)
def test_c_rank_is_the_python_rank(
    cands: list[Candidate], n: int, key: int, weights: ScoreWeights
) -> None:
    """router/_score.c scores and orders exactly as router/scoring.py: same order, same costs
    and credits to the bit (the C build has FP contraction off)."""
    import router.scoring as scoring

    assert scoring._c_rank is not None, _NOT_BUILT
    twins = [msgspec.structs.replace(c) for c in cands]
    got = rank(cands, n, weights, request_key=key)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(scoring, "_c_rank", None)
        want = rank(twins, n, weights, request_key=key)
    assert got == want
    assert [(c.cost, c.credited) for c in cands] == [(c.cost, c.credited) for c in twins]


def test_c_rank_declines_what_it_does_not_model() -> None:
    import router.scoring as scoring

    assert scoring._c_rank is not None, _NOT_BUILT
    c = Candidate(("w0", 0), by_tier={"GPU": 1}, whash=-1)
    tw = dict(W.tier_weights)
    assert scoring._c_rank([c], 4, 1.0, tw, 0.3, 0.0, 0.0, 0.0, 7) is None
    assert c.cost == float("inf")  # untouched
    c = Candidate(("w0", 0), by_tier={"GPU": 2**70}, whash=1)
    assert scoring._c_rank([c], 4, 1.0, tw, 0.3, 0.0, 0.0, 0.0, 7) is None
    c = Candidate(("w0", 0), by_tier={"GPU": 1}, whash=1)
    assert scoring._c_rank([c], 4, 1.0, tw, 0.3, 0.0, 0.0, 0.0, 7) == [0]
    assert (c.credited, c.cost) == (1.0, 3.0)
