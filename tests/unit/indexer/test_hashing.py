"""Router block hash: the C accelerator and the Python reference agree; chaining and seeding."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer import hashing
from indexer.hashing import chain_hashes, namespace_seed, py_chain_hashes

pytestmark = pytest.mark.skipif(
    not hashing.HAVE_C_HASH, reason="C extension not built (needs a compiler, not a GPU)"
)

tokens = st.lists(st.one_of(st.integers(0, 300_000), st.integers(-(2**63), 2**70)), max_size=80)


@given(tokens, st.integers(1, 17), st.integers(0, 2**64 - 1))
def test_c_matches_python(toks: list[int], bs: int, parent: int) -> None:
    assert chain_hashes(toks, bs, parent) == py_chain_hashes(toks, bs, parent)


def test_only_full_blocks_and_prefix_property() -> None:
    rng = random.Random(3)
    t = [rng.randrange(50_000) for _ in range(100)]
    h = chain_hashes(t, 16, 7)
    assert len(h) == 6
    assert chain_hashes(t[:48], 16, 7) == h[:3]
    # a change in block 2 changes every later hash, none before
    t2 = list(t)
    t2[40] += 1
    h2 = chain_hashes(t2, 16, 7)
    assert h2[:2] == h[:2]
    assert all(a != b for a, b in zip(h2[2:], h[2:]))


def test_namespaces_are_distinct_and_stable() -> None:
    assert namespace_seed("m", None) == namespace_seed("m", "")
    seeds = {namespace_seed(m, lora) for m in ("", "a", "b") for lora in (None, "x", "y")}
    assert len(seeds) == 9
    assert namespace_seed("llama") == namespace_seed("llama")


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="token_ids must hold ints"):
        chain_hashes([1, "2"], 1, 0)
    with pytest.raises(ValueError, match="block_size must be positive"):
        chain_hashes([1], 0, 0)
    with pytest.raises(TypeError, match="token_ids must hold ints"):
        py_chain_hashes([1, 2.0], 1, 0)
