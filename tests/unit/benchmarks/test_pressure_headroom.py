"""The cache bounds of ``benchmarks/pressure_headroom.py`` on traces small enough to check by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from pressure_headroom import opt_hit, priority_hit, s3fifo_hit

from kvrouter.replay.trace import TraceRequest, ideal_hit, pooled_lru_hit

B = 4  # tokens per trace block


def req(*ids: int) -> TraceRequest:
    return TraceRequest(0.0, ids, len(ids) * B, 1)  # one answer block each


def test_belady_keeps_what_comes_back_where_lru_keeps_what_came_last() -> None:
    # 3 slots; A's blocks come back after B's. LRU (room for one answer block too) evicts A for
    # B; Belady evicts B and the answers, which nothing uses again.
    reqs = [req(1, 2), req(3, 4), req(1, 2)]
    assert pooled_lru_hit(reqs, B, 3 * B) == 0.0
    assert opt_hit(reqs, B, 3) == pytest.approx(2 / 6)
    assert opt_hit(reqs, B, 3) == pytest.approx(ideal_hit(reqs, B))


def test_bounds_meet_the_ideal_when_everything_fits() -> None:
    reqs = [req(1, 2, 3), req(1, 2, 5), req(1, 6), req(1, 2, 3, 7)]
    ideal = ideal_hit(reqs, B)
    assert ideal > 0
    for hit in (opt_hit(reqs, B, 100), s3fifo_hit(reqs, B, 100), priority_hit(reqs, B, 100, 0.2)):
        assert hit == pytest.approx(ideal)


def test_priority_keeps_a_follow_ups_blocks_over_a_first_turns() -> None:
    # 1,2 is a first turn, 1,2,3 its follow-up (it becomes "hi"), 8,9 a new first turn whose
    # store must evict: capped at 40 % of 5 slots, the first turns' and answers' blocks go first
    reqs = [req(1, 2), req(1, 2, 3), req(8, 9), req(1, 2, 3, 4)]
    assert priority_hit(reqs, B, 5, 0.4) > pooled_lru_hit(reqs, B, 5 * B)
