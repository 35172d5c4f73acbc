"""Predicted blocks (TTL overlay) and load accounting, with controlled clocks."""

from __future__ import annotations

from router.placement.load import LoadLedger
from router.placement.predict import PredictedBlocks


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_predictions_expire_by_ttl_and_newer_ones_survive():
    clock = Clock()
    p = PredictedBlocks(2.0, clock=clock)
    assert p.overlay() is None
    p.record([1, 2, 3], slot=0)
    p.record([1, 2], slot=3)
    assert p.overlay() == {1: 0b1001, 2: 0b1001, 3: 0b1}
    clock.t += 1.5
    p.record([1], slot=0)  # renewed on slot 0
    clock.t += 1.0
    p.expire()
    assert p.overlay() == {1: 0b1}
    clock.t += 1.5
    p.expire()
    assert p.overlay() is None and len(p) == 0


def test_prediction_cap_and_slot_drop():
    p = PredictedBlocks(10.0, max_blocks=4, clock=Clock())
    p.record([1, 2, 3], slot=0)
    p.record([4, 5, 6], slot=1)
    assert len(p) <= 4 and p.expired_early == 1
    assert p.mask == {4: 2, 5: 2, 6: 2}
    p.drop_slot(1)
    assert p.overlay() is None
    off = PredictedBlocks(0.0)
    off.record([1], slot=0)
    assert off.overlay() is None


def test_load_accounting_prefill_until_first_token_active_until_finish():
    t = LoadLedger()
    key = ("a", 0)
    x = t.start(key, [1, 2, 3, 4], prefill=3.0, matched_blocks=1)
    y = t.start(key, [1, 2, 9], prefill=1.0, matched_blocks=2, weight=2.5)
    ld = t.get(key)
    assert ld is not None
    assert ld.inflight_prefill == 4.0
    assert ld.active_blocks == 5 + 2  # distinct blocks {1,2,3,4,9} + one per request
    assert t.shared(key, [1, 2, 3, 7]) == (3, 2)  # 1-3 active; 2 and 3 still being built by x
    assert t.shared(("b", 0), [1]) == (0, 0)
    # both will decode here while a prefill placed now runs: their weights count from the start
    assert ld.stall == 1.0 + 2.5
    t.first_token(x)
    t.first_token(x)  # idempotent
    assert ld.inflight_prefill == 1.0 and ld.stall == 3.5
    assert t.shared(key, [1, 2, 3]) == (3, 0)
    t.finish(x)
    assert ld.active_blocks == 3 + 1 and t.inflight("a") == 1 and ld.stall == 2.5
    t.finish(y)  # finished before any first token (an error): it decoded, then ended
    assert ld.stall == 0.0
    t.finish(y)
    assert t.get(key) is None


def test_might_meet_finds_every_request_sharing_a_predicted_segment():
    clock = Clock()
    p = PredictedBlocks(2.0, clock=clock)
    assert not p.might_meet([1, 2, 3])
    p.record([5, 6, 7], slot=1)  # a chain segment: blocks 0-4 were held already
    assert p.might_meet([1, 2, 3, 4, 5])  # contains the segment's first block
    assert p.might_meet([1, 2, 3, 4, 5, 6, 9])
    assert not p.might_meet([1, 2, 3, 4])
    clock.t += 3
    p.expire()
    assert not p.might_meet([1, 2, 3, 4, 5, 6])
    p.record([8], slot=2)
    p.drop_slot(2)
    assert not p.might_meet([8])


def test_counts_add_twins_agree():
    """The C refcount update the load accounting uses, against its Python twin."""
    import random

    import router.placement.load as load

    rng = random.Random(9)
    a: dict[int, int] = {}
    b: dict[int, int] = {}
    for _ in range(400):
        keys = [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
        delta = rng.choice([1, 1, -1, 2, -3])
        load._counts_add(a, keys, delta)
        load._py_counts_add(b, keys, delta)
        assert a == b
        assert all(v > 0 for v in a.values())
