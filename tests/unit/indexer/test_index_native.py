"""The index's native twins (``indexer/index/native.py``): the C walk against its Python twin,
and the C present table (MaskMap) against a dict."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def test_walk_twins_agree() -> None:
    import random

    from indexer.index.native import _py_walk_lengths
    from indexer.index.native import new_present as _new_present
    from indexer.index.native import walk_lengths as _walk_lengths

    rng = random.Random(5)
    for _ in range(300):
        # past 512 blocks the C walk keeps its keys on the heap; up to 64 slots it uses words
        n = rng.choice([rng.randrange(0, 30), rng.randrange(500, 700)])
        nslots = rng.choice([1, 3, 8, 9, 63, 64, 72])
        hashes: list[int] = list(range(n))
        if n and rng.random() < 0.2:  # a hash no table can hold ends the walk
            hashes[rng.randrange(n)] = -1
        full = (1 << nslots) - 1
        present = {
            h: rng.choice([1, 3, 7, 7, 7, full, 2**70 + 7]) & full or 1
            for h in hashes
            if h >= 0 and rng.random() < (0.95 if n < 30 else 0.999)
        }
        alive = rng.choice([7, 3, 1, 2**70 + 7, 2**71 - 1]) & full
        table = _new_present()
        for h, m in present.items():
            table[h] = m
        assert _walk_lengths(table, hashes, alive, nslots) == _py_walk_lengths(
            present, hashes, alive, nslots
        )


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["set", "del", "pop", "get"]),
            st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1)),
            st.integers(1, 2**80),
        ),
        max_size=400,
    ),
    seed=st.integers(0, 2**64 - 1),
)
def test_mask_map_behaves_like_a_dict(ops: list[tuple[str, int, int]], seed: int) -> None:
    """The present table (the C MaskMap where built) against a dict: growth, backward-shift
    deletion, the mapping API the index's Python paths use."""
    from indexer.index.native import MaskMap as _MaskMap

    m: Any = _MaskMap(seed) if _MaskMap is not None else {}
    d: dict[int, int] = {}
    for op, k, v in ops:
        if op == "set":
            m[k] = d[k] = v
        elif op == "del":
            if k in d:
                del m[k], d[k]
            else:
                with pytest.raises(KeyError):
                    del m[k]
        elif op == "pop":
            assert m.pop(k, None) == d.pop(k, None)
        else:
            assert m.get(k) == d.get(k) and m.get(k, 0) == d.get(k, 0) and (k in m) == (k in d)
        assert len(m) == len(d)
    assert sorted(m.items()) == sorted(d.items()) and sorted(m) == sorted(d)
    assert m.get(-1) is None and m.get(2**64) is None and -1 not in m and "x" not in m
    if _MaskMap is not None:  # keys are 64-bit hashes and values masks: nothing else is stored
        with pytest.raises(TypeError):
            m[1] = "not an int"
        with pytest.raises(OverflowError):
            m[2**64] = 1
    m.clear()
    assert len(m) == 0 and not m and list(m.items()) == []
