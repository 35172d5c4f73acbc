"""A fuzzer of the snapshot decoder (issue 37): bounded hypothesis mutations of a valid snapshot
(every kind of rank: plain, several tiers, duplicate stores, a re-chunked one) - bit flips,
truncations, and at the msgpack level any field replaced with an extreme int, a wrong type, a
list repeating its items or made huge - must give an index or a ``SnapshotError``, nothing else,
each within a second. (The warm start over HTTP gets a few of them too:
tests/integration/router/replicas/test_replicas_warm_budget.py.)"""

from __future__ import annotations

import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snapshot_mutations import BASE, PATHS, mutated

from indexer.index import DecodeBudget, PrefixIndex, SnapshotError

relaxed = settings(
    deadline=None, max_examples=250, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

U64 = 2**64 - 1
I64_MIN = -(2**63)


extremes = st.one_of(
    st.sampled_from([0, -1, 1, I64_MIN, U64, 2**63, 2**32, 16, 17, 1 << 16]),
    st.integers(I64_MIN, U64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.booleans(),
    st.text(max_size=4),
    st.binary(max_size=70),
    st.lists(st.integers(-2, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 1), max_size=2),
)


def decodes_or_refuses(data: bytes) -> None:
    t0 = time.monotonic()
    try:
        PrefixIndex.from_snapshot_bytes(data, DecodeBudget(100_000, t0 + 5))
    except SnapshotError:
        pass
    assert time.monotonic() - t0 < 1.0


def test_the_base_snapshot_is_valid() -> None:
    ix, seqs = PrefixIndex.from_snapshot_bytes(BASE)
    assert sorted(ix.workers()) == [("paged", 0), ("w", 0), ("w", 1)] and len(seqs) == 3
    assert ix.worker(("w", 0)).dups and ix.worker(("paged", 0)).rechunk is not None
    assert len(PATHS) > 60  # every field of every kind of rank is reached


@relaxed
@given(st.sampled_from(PATHS), st.sampled_from(["replace", "repeat", "huge", "drop"]), extremes)
def test_a_mutated_field_decodes_or_is_refused(path: tuple, how: str, value: Any) -> None:
    decodes_or_refuses(mutated(path, how, value))


@relaxed
@given(
    st.lists(st.tuples(st.integers(0, len(BASE) - 1), st.integers(0, 7)), min_size=1, max_size=8)
)
def test_flipped_bits_decode_or_are_refused(flips: list[tuple[int, int]]) -> None:
    data = bytearray(BASE)
    for pos, bit in flips:
        data[pos] ^= 1 << bit
    decodes_or_refuses(bytes(data))


@relaxed
@given(st.integers(0, len(BASE) - 1), st.binary(max_size=16))
def test_a_truncated_or_extended_snapshot_decodes_or_is_refused(cut: int, tail: bytes) -> None:
    decodes_or_refuses(BASE[:cut] + tail)
