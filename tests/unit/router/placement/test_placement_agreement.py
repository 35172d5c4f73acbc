"""The agreement between a worker's reported cache and the index (router.placement.agreement):
one answer judged, and the per-worker estimate the closed loop keeps."""

from __future__ import annotations

import pytest

from router.placement import cached_tokens
from router.placement.agreement import (
    AGREE,
    CAUSES,
    INDEX_AHEAD,
    NO_SIGNAL,
    WORKER_AHEAD,
    AgreementEstimator,
    Observation,
    compare,
    reusable_tokens,
)

BS = 16


def obs(
    reported: int,
    *,
    gpu: int = 0,
    cpu: int = 0,
    predicted: int = 0,
    tokens: int = 10 * BS + 5,
    worker: str = "w0",
    engine_bs: int = 0,
) -> Observation:
    tiers = {"GPU": gpu, "CPU_PINNED": cpu}
    return Observation(worker, tokens, BS, tiers, predicted, reported, engine_bs)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_reusable_tokens_are_whole_blocks_and_never_the_last_prompt_token() -> None:
    assert reusable_tokens(10, 10 * BS + 5, BS) == 10 * BS
    assert reusable_tokens(10, 10 * BS, BS) == 9 * BS  # the last token is always computed
    assert reusable_tokens(3, 10 * BS, BS) == 3 * BS
    assert reusable_tokens(5, 0, BS) == 0


def test_the_placement_and_the_comparison_count_reusable_tokens_alike() -> None:
    # one home: pd.cached_tokens (Placer.fly's prediction too) is reusable_tokens
    from router.placement.scoring import Candidate

    c = Candidate(("w", 0), True, 10, {"GPU": 10}, 0, 0.0, 0, 0, 0.0, None, 0, 0)
    assert cached_tokens(c, 10 * BS, BS) == reusable_tokens(10, 10 * BS, BS) == 9 * BS


def test_a_report_equal_to_the_prediction_agrees() -> None:
    c = compare(obs(10 * BS, gpu=8, cpu=2))
    assert (c.kind, c.expected, c.confirmed, c.reported, c.likely) == (
        AGREE,
        10 * BS,
        10 * BS,
        10 * BS,
        "",
    )
    assert c.agrees


def test_a_report_within_one_engine_block_agrees_one_block_off_does_not() -> None:
    # vLLM rounds to its own block: 32-token pages report up to 31 tokens short
    assert compare(obs(8 * BS, gpu=9, engine_bs=2 * BS)).kind == AGREE
    assert compare(obs(7 * BS, gpu=9, engine_bs=2 * BS)).kind == INDEX_AHEAD
    # same block size: a whole block off is a disagreement
    assert compare(obs(8 * BS, gpu=9)).kind == INDEX_AHEAD
    assert compare(obs(9 * BS + 3, gpu=9)).kind == AGREE


def test_nothing_predicted_nothing_reported_is_no_signal() -> None:
    c = compare(obs(0))
    assert c.kind == NO_SIGNAL and c.agrees


def test_the_index_ahead_of_a_worker_that_reuses_nothing_it_held() -> None:
    # the events said the blocks were there; the worker reuses none: restart or caching off
    c = compare(obs(0, gpu=10))
    assert c.kind == INDEX_AHEAD and not c.agrees
    assert "silent restart" in c.likely


def test_the_index_ahead_on_blocks_the_events_held_is_lost_removals() -> None:
    c = compare(obs(4 * BS, gpu=10))
    assert c.kind == INDEX_AHEAD
    assert c.likely == CAUSES[INDEX_AHEAD]
    assert "lost removals" in c.likely


def test_the_index_ahead_on_predictions_alone_names_the_tokenizer() -> None:
    # a router tokenizer that makes more tokens than the worker's: the router predicts its
    # own 10 blocks there (it routed the prefix there), the worker reuses its 3
    c = compare(obs(3 * BS, predicted=10))
    assert (c.kind, c.expected, c.confirmed) == (INDEX_AHEAD, 10 * BS, 0)
    assert "tokenizer" in c.likely and "never confirmed" in c.likely


def test_a_worker_reporting_hits_its_events_never_matched() -> None:
    # kvrouter check's shape of a tokenizer or hash-seed mismatch: the events' view alone
    c = compare(obs(6 * BS))
    assert (c.kind, c.expected, c.reported) == (WORKER_AHEAD, 0, 6 * BS)
    assert "never matched" in c.likely and "tokenizer" in c.likely


def test_a_worker_ahead_of_part_of_its_events_is_lost_stores() -> None:
    c = compare(obs(9 * BS, gpu=3))
    assert c.kind == WORKER_AHEAD and c.likely == CAUSES[WORKER_AHEAD]
    assert "lost stores" in c.likely


def test_a_bad_block_size_is_refused() -> None:
    with pytest.raises(ValueError):
        compare(Observation("w", 100, 0, {}, 0, 0))


def test_the_estimator_waits_for_enough_requests_then_names_the_cause_once() -> None:
    est = AgreementEstimator(window=20, threshold=0.5, min_requests=5, clock=Clock())
    changes = [est.observe(obs(6 * BS)) for _ in range(10)]
    first = next(i for i, v in enumerate(changes) if v is not None)
    assert first == 4  # the 5th request: min_requests reached
    v = changes[first]
    assert v is not None and not v.agrees and v.kind == WORKER_AHEAD
    assert v.requests == 5 and v.disagreeing == 5 and "never matched" in v.likely
    assert all(x is None for x in changes[first + 1 :])  # said once
    assert not est.verdict("w0").agrees


def test_no_signal_answers_never_dilute_the_estimate() -> None:
    est = AgreementEstimator(window=10, threshold=0.5, min_requests=4, clock=Clock())
    for _ in range(50):
        assert est.observe(obs(0)) is None
    assert est.verdict("w0").requests == 0
    for _ in range(3):
        est.observe(obs(0, gpu=10))
    v = est.observe(obs(0, gpu=10))
    assert v is not None and v.kind == INDEX_AHEAD and "silent restart" in v.likely


def test_agreeing_reports_below_the_threshold_never_turn_a_worker() -> None:
    est = AgreementEstimator(window=10, threshold=0.5, min_requests=4, clock=Clock())
    for i in range(40):  # one in four disagrees (requests that raced their prefix's prefill)
        r = 0 if i % 4 == 0 else 10 * BS
        assert est.observe(obs(r, gpu=10)) is None
    v = est.verdict("w0")
    assert v.agrees and v.requests == 10 and 0 < v.disagreeing < 5


def test_a_worker_agrees_again_only_well_below_the_line() -> None:
    est = AgreementEstimator(window=10, threshold=0.5, min_requests=4, clock=Clock())
    for _ in range(10):
        est.observe(obs(0, gpu=10))
    assert not est.verdict("w0").agrees
    # agreeing answers push the bad ones out: at 5/10 bad it still disagrees (hysteresis:
    # back under threshold / 2 = 25 %), at 2/10 it agrees again, said once
    changes = [est.observe(obs(10 * BS, gpu=10)) for _ in range(10)]
    back = [i for i, v in enumerate(changes) if v is not None]
    assert back == [7]  # the 8th agreeing answer leaves 2 of 10 bad
    assert changes[7] is not None and changes[7].agrees and changes[7].kind == ""


def test_old_answers_leave_the_window_by_age() -> None:
    clock = Clock()
    est = AgreementEstimator(window=100, window_s=60, threshold=0.5, min_requests=4, clock=clock)
    for _ in range(4):
        est.observe(obs(0, gpu=10))
    assert not est.verdict("w0").agrees
    clock.t += 61
    v = est.verdict("w0")
    assert v.agrees and v.requests == 0


def test_workers_are_estimated_apart_and_forgotten() -> None:
    est = AgreementEstimator(window=10, threshold=0.5, min_requests=2, clock=Clock())
    for _ in range(3):
        est.observe(obs(0, gpu=10, worker="bad"))
        est.observe(obs(10 * BS, gpu=10, worker="good"))
    assert not est.verdict("bad").agrees and est.verdict("good").agrees
    assert est.workers() == ["bad", "good"]
    est.forget("bad")
    assert est.verdict("bad").agrees and est.workers() == ["good"]
    assert est.verdict("never-seen").agrees


def test_the_dominant_disagreement_is_the_verdict() -> None:
    est = AgreementEstimator(window=10, threshold=0.5, min_requests=6, clock=Clock())
    for r in (0, 0, 0, 0, 6 * BS, 6 * BS):
        est.observe(obs(r, gpu=10 if r == 0 else 0))
    v = est.verdict("w0")
    assert not v.agrees and v.kind == INDEX_AHEAD
    assert v.counts == {AGREE: 0, INDEX_AHEAD: 4, WORKER_AHEAD: 2}


def test_a_few_worker_ahead_answers_in_a_full_window_turn_a_worker() -> None:
    # lost stores: most answers agree (the router sends the lost prefixes elsewhere), a few
    # report hits the index never predicted; right events give none of those
    est = AgreementEstimator(
        window=20, threshold=0.5, ahead_threshold=0.2, min_requests=4, clock=Clock()
    )
    assert est.observe(obs(6 * BS)) is None  # one early answer: below min_requests
    for _ in range(4):
        assert est.observe(obs(10 * BS, gpu=10)) is None
    # 1 of 5 is past a 0.2 share, but not 0.2 of a full window: still agrees
    assert est.verdict("w0").agrees
    for _ in range(2):
        assert est.observe(obs(6 * BS)) is None
    v = est.observe(obs(6 * BS))  # the 4th of a window of 20: 0.2 of it
    assert v is not None and not v.agrees and v.kind == WORKER_AHEAD
    assert v.counts == {AGREE: 4, INDEX_AHEAD: 0, WORKER_AHEAD: 4}
    # it agrees again below half the line: once 3 of the 4 have left the window
    changes = [est.observe(obs(10 * BS, gpu=10)) for _ in range(20)]
    back = [i for i, c in enumerate(changes) if c is not None]
    assert back == [18] and est.verdict("w0").agrees


def test_bad_settings_are_refused() -> None:
    for kw in (
        {"window": 0},
        {"min_requests": 0},
        {"threshold": 0.0},
        {"threshold": 1.5},
        {"ahead_threshold": 0.0},
    ):
        with pytest.raises(ValueError):
            AgreementEstimator(**kw)  # type: ignore[arg-type]


def test_an_answer_whose_prompt_its_events_never_showed_is_worker_ahead() -> None:
    # a worker the router sends only new prefixes: nothing predicted, nothing reported, yet
    # its events (which announce other stores) never showed the prompt it just computed
    silent = Observation("w", 10 * BS + 5, BS, {}, 0, 0, 0, False)
    c = compare(silent)
    assert c.kind == WORKER_AHEAD and "never showed" in c.likely and "hash seed" in c.likely
    assert compare(Observation("w", 10 * BS + 5, BS, {}, 0, 0, 0, True)).kind == NO_SIGNAL
    assert compare(Observation("w", 10 * BS + 5, BS, {}, 0, 0, 0, None)).kind == NO_SIGNAL
    # a disagreement of its own keeps its shape and cause
    lost = compare(Observation("w", 10 * BS + 5, BS, {"GPU": 10}, 0, 0, 0, False))
    assert lost.kind == INDEX_AHEAD
