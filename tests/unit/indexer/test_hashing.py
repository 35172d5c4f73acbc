"""Router block hash: the C accelerator and the Python reference agree; chaining and seeding."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import hashing
from indexer.hashing import chain_hashes, namespace_seed, py_chain_hashes

pytestmark = pytest.mark.skipif(
    not hashing.HAVE_C_HASH, reason="C extension not built (needs a compiler, not a GPU)"
)

tokens = st.lists(st.one_of(st.integers(0, 300_000), st.integers(-(2**63), 2**70)), max_size=80)


# no per-example deadline: the first example loads the C layer, and a loaded CI machine is slow
@settings(deadline=None)
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


# ---- chain_hashes_json: hashes straight from the JSON text of a token array ----------------------

_WS = b" \t\n\r"
_U64 = 2**64


def _ref_json(text: bytes, bs: int, parent: int) -> tuple[list[int], int] | None:
    """The accept rules of ``chain_hashes_json``, byte by byte: ``ws [ ws ] ws`` or
    ``ws [ ws num (ws , ws num)* ws ] ws`` with JSON whitespace, each num a run of digits with no
    leading zero and a value below 2**63 (a token id fits the engines' int64; the router answers
    anything else with 422); anything else is not plain (None)."""
    n = len(text)

    def skip_ws(i: int) -> int:
        while i < n and text[i] in _WS:
            i += 1
        return i

    i = skip_ws(0)
    if i >= n or text[i] != ord("["):
        return None
    i = skip_ws(i + 1)
    toks: list[int] = []
    if i < n and text[i] == ord("]"):
        i += 1
    else:
        while True:
            j = i
            while j < n and 0x30 <= text[j] <= 0x39:
                j += 1
            digits = text[i:j]
            if not digits or (len(digits) > 1 and digits[0] == ord("0")) or len(digits) > 20:
                return None
            if int(digits) >= _U64 >> 1:
                return None
            toks.append(int(digits))
            i = skip_ws(j)
            if i < n and text[i] == ord(","):
                i = skip_ws(i + 1)
                continue
            if i < n and text[i] == ord("]"):
                i += 1
                break
            return None
    if skip_ws(i) != n:
        return None
    return py_chain_hashes(toks, bs, parent), len(toks)


def _check_json(text: bytes, bs: int = 3, parent: int = 11) -> None:
    assert hashing.chain_hashes_json is not None
    assert hashing.chain_hashes_json(text, bs, parent) == _ref_json(text, bs, parent), text


json_ws = st.text(alphabet=" \t\n\r", max_size=3)
json_tokens = st.lists(
    st.one_of(
        st.integers(0, 300_000),
        st.integers(0, 9),
        st.integers(0, (_U64 >> 1) - 1),  # token ids: int64 (the scan declines larger ones)
        st.sampled_from([0, 9_999_999, 10_000_000, 99_999_999, 10**15, 10**18, (_U64 >> 1) - 1]),
    ),
    max_size=120,
)


# no per-example deadline: the first example loads the C layer, and a loaded CI machine is slow
@settings(deadline=None)
@given(
    json_tokens,
    st.data(),
    st.integers(1, 17),
    st.integers(0, _U64 - 1),
)
def test_json_plain_arrays_hash_like_the_list(
    toks: list[int], data: st.DataObject, bs: int, parent: int
) -> None:
    # one separator for most of the array (as encoders write it), some elements spaced otherwise
    usual = data.draw(st.sampled_from([", ", ",", " , ", ",\n  "]))
    seps = data.draw(
        st.lists(
            st.one_of(st.just(usual), st.builds(lambda a, b: f"{a},{b}", json_ws, json_ws)),
            min_size=max(len(toks) - 1, 0),
            max_size=max(len(toks) - 1, 0),
        )
    )
    body = "".join(f"{t}{s}" for t, s in zip(toks, [*seps, ""]))
    lead, inner_l, inner_r, trail = (data.draw(json_ws) for _ in range(4))
    text = f"{lead}[{inner_l}{body}{inner_r}]{trail}".encode()
    assert hashing.chain_hashes_json(text, bs, parent) == (
        py_chain_hashes(toks, bs, parent),
        len(toks),
    )
    # the same text cut short, or with a byte changed, is judged exactly like the reference does
    cut = data.draw(st.integers(0, len(text)))
    _check_json(text[:cut], bs, parent)
    if text:
        at = data.draw(st.integers(0, len(text) - 1))
        byte = data.draw(st.sampled_from(b"0123456789, \t\n[]-+.eE\x00\x7f\xb0\xff"))
        _check_json(text[:at] + bytes([byte]) + text[at + 1 :], bs, parent)


# no per-example deadline: the first example loads the C layer, and a loaded CI machine is slow
@settings(deadline=None)
@given(st.binary(max_size=40), st.text(alphabet="0123456789, \t\n[]-.e", max_size=60))
def test_json_arbitrary_bytes_judged_like_the_reference(raw: bytes, text: str) -> None:
    _check_json(raw)
    _check_json(text.encode())
    _check_json(b"[" + text.encode())


def test_json_tricky_texts() -> None:
    long = ", ".join(str(i * 7919 % 300_000) for i in range(40))  # gets the SWAR path going
    tricky = [
        b"", b"[", b"]", b"[]", b"[ ]", b" [ ] ", b"[]x", b"[] ,", b"[,]", b"[,1]", b"[1,]",
        b"[1,,2]", b"[1 2]", b"[1]x", b"[1]]", b"[[1]]", b" [ 1 , 2 ] ", b"\t[\n1,\r2\n]\n", b"[01]",
        b"[00]", b"[0]", b"[0,0]", b"[10]", b"[-1]", b"[+1]", b"[-0]", b"[1.0]", b"[1e3]", b"[1E3]",
        b"[0x1]", b'["1"]', b"[true]", b"[null]", b"[1\x00]", b"[\xb01]", b"[1\xb0]", b"[1\xff]",
        b"[18446744073709551615]", b"[18446744073709551616]", b"[99999999999999999999]",
        b"[018446744073709551615]", b"[000000000000000000001]", b"[100000000000000000000]",
        b"[1\f]", b"[1\v]", b"[1\xa0]",
    ]  # fmt: skip
    for digits in (1, 2, 6, 7, 8, 9, 15, 16, 17, 19, 20, 21):
        for lead in ("1", "9", "0"):
            num = lead + "7" * (digits - 1)
            tricky += [
                f"[{num}]".encode(),
                f"[{long}, {num}, 5]".encode(),
                f"[{num},{num}]".encode(),
            ]
    for sep in (", ", ",", " ,", ",  ", ",\t", " , "):
        for bad in (
            "01",
            "-1",
            "1.5",
            "1e3",
            "",
            " ",
            "a",
            "1a",
            "00",
            "0",
            "1]",
            "[1",
            "12345678",
        ):
            body = long.replace(", ", sep)
            tricky.append(f"[{body}{sep}{bad}{sep}{body}]".encode())
    for text in tricky:
        for bs in (1, 3, 16):
            _check_json(text, bs, 5)


def test_json_numbers_ending_near_the_buffer_end() -> None:
    # the fast path reads 8 bytes at a time: the last numbers end 0..9 bytes before the end
    rng = random.Random(7)
    for _ in range(200):
        toks = [rng.choice((rng.randrange(10), rng.randrange(300_000), rng.randrange(10**8)))
                for _ in range(rng.randrange(1, 12))]  # fmt: skip
        sep = rng.choice((", ", ","))
        full = ("[" + sep.join(map(str, toks)) + "]").encode()
        for tail in (b"", b" ", b"  ", b"\n", b"   \r\n", b"        ", b"x"):
            text = full + tail
            for cut in range(max(len(text) - 12, 0), len(text) + 1):
                _check_json(text[:cut], 4, 1)
        assert hashing.chain_hashes_json(full, 4, 1) == (py_chain_hashes(toks, 4, 1), len(toks))


def test_json_every_byte_of_a_long_array_judged_like_the_reference() -> None:
    # one byte changed anywhere in a long array (where the SWAR path runs), to anything that could
    # pass for part of one, a byte dropped, or a number too long for the fast path put in: judged
    # as the reference does
    rng = random.Random(5)
    toks = [rng.choice((rng.randrange(10), rng.randrange(1000), rng.randrange(10**7)))
            for _ in range(60)]  # fmt: skip
    for sep in (", ", ","):
        text = ("[" + sep.join(map(str, toks)) + "]").encode()
        assert hashing.chain_hashes_json(text, 4, 9) == (py_chain_hashes(toks, 4, 9), len(toks))
        for at in range(len(text)):
            for byte in b"0 ,\t-]\xb0":
                _check_json(text[:at] + bytes([byte]) + text[at + 1 :], 4, 9)
            _check_json(text[:at] + b"12345678" + text[at:], 4, 9)
            _check_json(text[:at] + text[at + 1 :], 4, 9)


def test_json_many_blocks_and_separators() -> None:
    rng = random.Random(11)
    toks = [rng.randrange(300_000) for _ in range(5_000)]
    for sep in ((", ", ": "), (",", ":")):
        text = json.dumps(toks, separators=sep).encode()
        for bs in (1, 16, 4_999, 5_000, 5_001):
            assert hashing.chain_hashes_json(text, bs, 3) == (py_chain_hashes(toks, bs, 3), 5_000)
    # any object exposing the buffer protocol is read the same
    text = json.dumps(toks).encode()
    assert hashing.chain_hashes_json(memoryview(text), 16, 3) == hashing.chain_hashes_json(
        bytearray(text), 16, 3
    )
    assert hashing.chain_hashes_json(bytearray(), 16, 3) is None
    assert hashing.chain_hashes_json(bytearray(b"[]"), 16, 3) == ([], 0)
    with pytest.raises(ValueError, match="block_size must be positive"):
        hashing.chain_hashes_json(b"[1]", 0, 0)
