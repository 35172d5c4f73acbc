"""Hostile bodies on the edge's decoders (issue 21): deep nesting, bad UTF-8, huge numbers,
NaN/Infinity, duplicate keys and non-objects are :class:`router.errors.RouterError` subclasses
that name the problem, with or without the C scanner; and, as a property, nothing but a
``RouterError`` ever comes out of decoding arbitrary bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import router.edge.bodies as api
from router.edge.bodies import (
    ChatBody,
    CompletionBody,
    RouteRequest,
    WorkerIn,
    check_messages,
    completion_tokens_source,
    decode,
    decode_route,
)
from router.errors import BadRequest, RouterError, UnprocessableEntity

relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHAPES: tuple[type, ...] = (RouteRequest, CompletionBody, ChatBody, WorkerIn)


@contextlib.contextmanager
def c_path(on: bool) -> Iterator[None]:
    """With the C scanners (``router._native``) or with their Python twins only."""
    if on:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(api, "_array_span", None))
        stack.enter_context(mock.patch.object(api, "_hash_json", None))
        with contextlib.suppress(ImportError):  # (the shape scan: where the fix keeps it)
            import router.edge.bodycheck as bodycheck

            stack.enter_context(mock.patch.object(bodycheck, "_c_shape", None))
        yield


def deep(n: int, inner: bytes = b"1") -> bytes:
    return b"[" * n + inner + b"]" * n


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize(
    "body",
    [
        b'{"token_ids":[1],"x":' + deep(5000) + b"}",  # issue 21's report: a 500 and a traceback
        b'{"x":' + deep(5000) + b',"token_ids":[1]}',
        b'{"token_ids":[1],"x":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
        b'{"token_ids":' + deep(5000) + b"}",
        b'{"token_ids":[1],"x":' + deep(129) + b"}",  # one past MAX_DEPTH, within msgspec's
        b'{"messages":[{"role":"user","content":' + deep(200) + b"}]}",
    ],
)
def test_deep_nesting_is_400_on_both_paths(body, on):
    with c_path(on), pytest.raises(BadRequest, match="nested more than 128 levels deep"):
        decode_route(body)


@pytest.mark.parametrize("on", [True, False])
def test_nesting_up_to_the_limit_is_accepted(on):
    with c_path(on):  # the body itself is level 1: 127 more in a field make 128
        req, tokens = decode_route(b'{"token_ids":[1,2],"x":' + deep(127) + b"}")
        assert tokens is not None and tokens.tokens() == [1, 2]
        req = decode(b'{"prompt":' + deep(127) + b"}", CompletionBody)
        assert req.prompt is not None
        with pytest.raises(BadRequest, match="nested"):
            decode(b'{"prompt":' + deep(128) + b"}", CompletionBody)


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize(
    "body",
    [
        b'{"token_ids":[1],"x":"\xff"}',  # msgspec skips an unknown string unread
        b'{"token_ids":[1],"x":{"\xc3\x28":1}}',
        b'{"token_ids":[1],"prompt":"\xfe"}',  # a UnicodeDecodeError escaped the C path
        b'{"token_ids":[1,2],"model":"\xed\xa0\x80"}',  # an encoded surrogate
        b'{"prompt":"ok"}\xff',
    ],
)
def test_bad_utf8_anywhere_is_400(body, on):
    with c_path(on), pytest.raises(BadRequest, match="not valid UTF-8"):
        decode_route(body)
    for shape in SHAPES:
        with pytest.raises(BadRequest, match="not valid UTF-8"):
            decode(body, shape)


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize(
    "body,key",
    [
        (b'{"token_ids":[1],"token_ids":[2]}', "token_ids"),
        (b'{"token_ids":[1],"model":"a","model":"b"}', "model"),
        (b'{"model":"a","token_ids":[1],"mod\\u0065l":"b"}', "model"),  # spelled with an escape
        (b'{"prompt":"a","account":true,"account":false}', "account"),
    ],
)
def test_a_field_given_twice_is_400_naming_it(body, key, on):
    with c_path(on), pytest.raises(BadRequest, match=f"duplicate key `{key}`"):
        decode_route(body)


@pytest.mark.parametrize("on", [True, False])
def test_repeats_the_router_does_not_read_are_let_through(on):
    with c_path(on):  # an unknown key twice, a field's name twice inside a nested object
        req, tokens = decode_route(b'{"x":1,"x":2,"token_ids":[3],"y":{"model":1,"model":2}}')
        assert tokens is not None and tokens.tokens() == [3] and req.model is None
        m = decode(b'{"messages":[{"role":"user","content":"model","model":1}]}', ChatBody)
        assert m.messages == [{"role": "user", "content": "model", "model": 1}]


@pytest.mark.parametrize(
    "body,error,match",
    [
        (b'{"token_ids":[NaN]}', BadRequest, "not valid JSON"),
        (b'{"token_ids":[1],"x":Infinity}', BadRequest, "not valid JSON"),
        (b'{"token_ids":[1],"account":-Infinity}', BadRequest, "not valid JSON"),
        (b'{"token_ids":[1e400]}', UnprocessableEntity, r"token_ids\[0\]: number out of range"),
        (b'{"token_ids":[18446744073709551616]}', UnprocessableEntity, r"token_ids\[0\]"),
        (b'{"token_ids":[99999999999999999999999]}', UnprocessableEntity, r"token_ids\[0\]"),
        (b'{"token_ids":[2,-1]}', UnprocessableEntity, r"token_ids\[1\]: expected `int` >= 0"),
        (b'{"token_ids":[1],"account":1e400}', UnprocessableEntity, "account"),
        (b"[1,2]", UnprocessableEntity, "expected `object`"),
        (b'"x"', UnprocessableEntity, "expected `object`"),
        (b"null", UnprocessableEntity, "expected `object`"),
        (deep(5000), UnprocessableEntity, "expected `object`"),
        (b"", BadRequest, "not valid JSON"),
    ],
)
def test_numbers_literals_and_non_objects(body, error, match):
    for on in (True, False):
        with c_path(on), pytest.raises(error, match=match):
            _, tokens = decode_route(body)
            assert tokens is not None
            tokens.hashes(4, 0)


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([1, -1], r"prompt\[1\]: expected a token id"),
        ([1, 2**64], r"prompt\[1\]: expected a token id"),
        ([1, True], r"prompt\[1\]: expected a token id"),
        ([1, 1.5], r"prompt\[1\]: expected a token id"),
        ([[1, 2], [3, -1]], r"prompt\[1\]\[1\]: expected a token id"),
        ([[1, 2], "x"], r"prompt\[1\]: expected a token list"),
        ([[[1]]], r"prompt\[0\]\[0\]: expected a token id"),
        (["a", 1], r"prompt\[1\]: expected a string"),
        ({"a": 1}, "prompt: expected a string"),
        (5, "prompt: expected a string"),
    ],
)
def test_completion_prompts_are_checked_whole(prompt, match):
    with pytest.raises(UnprocessableEntity, match=match):
        completion_tokens_source(prompt)


def test_completion_prompts_that_route():
    assert completion_tokens_source([[3, 4], [5]]) == [3, 4]
    assert completion_tokens_source(["a", "b"]) == "a"
    assert completion_tokens_source([0, (1 << 63) - 1]) == [0, (1 << 63) - 1]
    assert completion_tokens_source([[]]) is None and completion_tokens_source([]) is None


@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"role": 1}], r"messages\[0\]\.role: expected `str`"),
        ([{"role": "u", "content": 1}], r"messages\[0\]\.content: expected a string or a list"),
        ([{"role": "u", "content": [1]}], r"messages\[0\]\.content\[0\]: expected a string or"),
        ([{"role": "u", "content": [[]]}], r"messages\[0\]\.content\[0\]: expected a string or"),
        (
            [
                {"role": "u", "content": "x"},
                {"role": "u", "content": [{"type": "text", "text": []}]},
            ],
            r"messages\[1\]\.content\[0\]\.text: expected `str`",
        ),
    ],
)
def test_message_parts_the_router_reads_are_checked(messages, match):
    with pytest.raises(UnprocessableEntity, match=match):
        check_messages(messages)


def test_message_parts_the_router_does_not_read_pass():
    check_messages(
        [
            {"role": "user", "content": ["a", {"type": "text", "text": "b"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": 1}]},
        ]
    )


# ------------------------------------------------------------------------------ property

FRAGMENTS = [
    b"{", b"}", b"[", b"]", b":", b",", b" ", b'"', b"\\", b"1", b"-1", b"0", b"1e400", b"1.5",
    b"18446744073709551616", b"99999999999999999999999", b"NaN", b"Infinity", b"-Infinity",
    b"true", b"null", b'"x"', b'"\xff"', b'"\\ud800"', b'"\\u0041"', b"\xc3", b"\x00",
    b'"token_ids"', b'"model"', b'"prompt"', b'"messages"', b'"role"', b'"content"', b'"text"',
    b'"type"', b'"account"', b'"stream"', b'"id"', b'"url"', b'"dp_ranks"', b'"mod\\u0065l"',
]  # fmt: skip


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    parts = draw(st.lists(st.sampled_from(FRAGMENTS), max_size=40))
    body = b"".join(parts)
    if kind == 1:
        return body
    if kind == 2:  # an object around the fragments: reaches the decoders' later stages
        return b'{"token_ids":[1,2,3],' + body + b"}"
    n = draw(st.sampled_from([1, 126, 127, 128, 129, 900, 3000]))
    return b'{"token_ids":[1],"messages":[{"role":"user","content":' + deep(n, body) + b"}]}"


def _use(body: bytes) -> None:
    """Everything the endpoints do with a body before placing it."""
    req, tokens = decode_route(body)
    if tokens is not None:
        tokens.hashes(16, 0)
        tokens.tokens()
    if req.messages:
        check_messages(req.messages)
    c = decode(body, CompletionBody)
    completion_tokens_source(c.prompt)
    m = decode(body, ChatBody)
    if m.messages:
        check_messages(m.messages)
    decode(body, WorkerIn)


@pytest.mark.parametrize("on", [True, False])
@relaxed
@given(body=bodies())
def test_arbitrary_bytes_raise_only_router_errors(on: bool, body: bytes) -> None:
    with c_path(on):
        try:
            _use(body)
        except RouterError as e:
            assert 400 <= e.status < 500, e
        except Exception as e:  # the property: nothing else gets out
            raise AssertionError(f"{type(e).__name__}: {e!s:.200} on {body[:120]!r}") from e


def _depth(value: Any) -> int:
    stack, best = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            best = max(best, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return best


@relaxed
@given(n=st.integers(0, 400))
def test_what_decodes_is_never_deeper_than_the_limit(n: int) -> None:
    body = b'{"prompt":' + deep(n, b"[]") + b"}"
    try:
        req = decode(body, CompletionBody)
    except BadRequest as e:
        assert "nested" in e.message and n + 2 > 128
    else:
        assert 1 + _depth(req.prompt) <= 128
