"""``router.edge.bodycheck``: the C body scan (``router._native.json_shape``) and its Python twin
give the same keys and depth; brackets and escapes inside strings never count."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.edge import bodycheck
from router.edge.bodycheck import MAX_DEPTH, check_shape, json_depth, py_json_shape
from router.errors import BadRequest

relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
c_shape = pytest.importorskip("router._native").json_shape

tricky_text = st.text(alphabet='ab[]{}"\\/:,\u00e9\u2028\x01 ', max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky_text, inner, max_size=4),
    max_leaves=30,
)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _keys(raw: list[bytes]) -> list[str]:
    return [json.loads(b'"' + k + b'"') for k in raw]


@relaxed
@given(
    members=st.lists(st.tuples(tricky_text, json_values), max_size=6),
    wrap=st.integers(0, 140),
    ascii_only=st.booleans(),
    spaced=st.booleans(),
)
def test_the_c_scan_and_its_twin_agree(members, wrap, ascii_only, spaced):
    sep = (", ", ": ") if spaced else (",", ":")
    parts = [
        json.dumps(k, ensure_ascii=ascii_only) + sep[1] + json.dumps(v, ensure_ascii=ascii_only)
        for k, v in members
    ]
    parts.append('"w"' + sep[1] + "[" * wrap + "0" + "]" * wrap)
    body = ("{" + sep[0].join(parts) + "}").encode()
    depth = 1 + max([wrap] + [_depth(v) for _, v in members])
    c_keys, c_depth, escaped = c_shape(body)
    assert c_depth == depth
    assert escaped == any(b"\\" in k for k in c_keys)
    p_keys, p_depth, _ = py_json_shape(body)
    assert p_depth == min(depth, MAX_DEPTH + 1)
    assert json_depth(body, MAX_DEPTH) == min(depth, MAX_DEPTH + 1)
    if depth <= MAX_DEPTH:
        assert _keys(c_keys) == _keys(p_keys) == [k for k, _ in members] + ["w"]
    # and the check built on them answers alike
    names = frozenset(k for k, _ in members[:2])
    outcomes = []
    for scan in (c_shape, None):
        bodycheck_scan = bodycheck._c_shape
        bodycheck._c_shape = scan
        try:
            check_shape(body, names)
            outcomes.append("ok")
        except BadRequest as e:
            outcomes.append(e.message)
        finally:
            bodycheck._c_shape = bodycheck_scan
    assert outcomes[0] == outcomes[1]
    keys = [k for k, _ in members]
    dup = any(keys.count(k) > 1 for k in names)
    if depth > MAX_DEPTH:
        assert "nested" in outcomes[0]
    else:
        assert ("duplicate" in outcomes[0]) == dup


@pytest.mark.parametrize(
    "body,depth",
    [
        (b"{}", 1),
        (b'{"a":"[[[{{{"}', 1),
        (b'{"a":"\\"[[["}', 1),  # an escaped quote does not end the string
        (b'{"a":"\\\\","b":[[]]}', 3),  # an escaped backslash does not escape the quote
        (b'{"a":"\\\\\\"]]]"}', 1),
        (b'{"a":[{"b":[{}]}]}', 5),
        (b'{"a":[1,[2,[3]],{"b":{}}]}', 4),
        (b' {"a" : [ ] , "b" : { "c" : [ [ ] ] } } ', 4),
    ],
)
def test_depth_counts_only_brackets_outside_strings(body, depth):
    assert json_depth(body, MAX_DEPTH) == depth
    assert c_shape(body)[1] == depth
    assert py_json_shape(body)[1] == depth


def test_not_an_object_has_no_shape():
    for body in (b"[]", b'"x"', b"1", b"null", b"  [{}]"):
        assert c_shape(body) is None and py_json_shape(body) is None


def test_keys_come_back_as_written():
    keys, depth, escaped = c_shape(b'{"a":1,"b\\u0041":{"a":2},"a":3}')
    assert (keys, depth, escaped) == ([b"a", b"b\\u0041", b"a"], 2, True)
    with pytest.raises(BadRequest, match="duplicate key `bA`"):
        check_shape(b'{"bA":1,"b\\u0041":2}', frozenset({"bA"}))
    check_shape(b'{"a":1,"a":2}', frozenset({"b"}))  # not a field the router reads
