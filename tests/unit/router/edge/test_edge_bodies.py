"""``token_ids`` hashed straight from JSON text must equal the index's own request hashes."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

import router.edge.bodies as api
from indexer.hashing import namespace_seed
from indexer.index import PrefixIndex
from router.edge.bodies import JsonTokens, RouteRequest, decode
from router.errors import BadRequest, UnprocessableEntity


def _raw(body: bytes) -> msgspec.Raw:
    return decode(body, RouteRequest).token_ids


@pytest.mark.parametrize("c_path", [True, False])
def test_same_hashes_as_the_index(c_path, monkeypatch):
    if not c_path:
        monkeypatch.setattr(api, "_hash_json", None)
    rng = random.Random(3)
    idx = PrefixIndex(16)
    for _ in range(300):
        tokens = [rng.randrange(1 << rng.choice((8, 17, 32))) for _ in range(rng.randrange(0, 200))]
        sep = rng.choice([(",", ":"), (", ", ": ")])
        body = json.dumps({"model": "m", "token_ids": tokens}, separators=sep).encode()
        jt = JsonTokens(_raw(body))
        seed = namespace_seed("m", "lora")
        assert jt.hashes(16, seed) == idx.request_hashes(tokens, model="m", lora_name="lora")
        assert jt.count == len(tokens)
        assert jt.tokens() == tokens


def test_declined_texts_fall_back_or_name_the_field():
    idx = PrefixIndex(4)
    spaced = JsonTokens(_raw(b'{"token_ids": [ 1 ,2, 3, 4 ]}'))  # decoded or scanned: same hashes
    assert spaced.hashes(4, namespace_seed()) == idx.request_hashes([1, 2, 3, 4])
    # ids outside [0, 2^63) are the client's error, on the C scan's path and the decode's alike
    for bad in (b"-1", b"9223372036854775808", b"18446744073709551615"):
        with pytest.raises(UnprocessableEntity, match=r"token_ids\[0\]: expected `int`"):
            JsonTokens(_raw(b'{"token_ids": [' + bad + b", 2, 3, 4]}")).hashes(4, 0)
    with pytest.raises(UnprocessableEntity, match=r"token_ids\[1\]: expected `int`"):
        JsonTokens(_raw(b'{"token_ids": [1, "x", 3, 4]}')).hashes(4, 0)
    with pytest.raises(UnprocessableEntity, match="token_ids: expected `array`"):
        JsonTokens(_raw(b'{"token_ids": "abc"}')).hashes(4, 0)
    with pytest.raises(UnprocessableEntity, match=r"token_ids\[0\]: expected `int`"):
        JsonTokens(_raw(b'{"token_ids": [1.5, 2, 3, 4]}')).hashes(4, 0)


@pytest.mark.parametrize("c_path", [True, False])
def test_decode_route_cuts_the_array_out_or_decodes_the_whole_body(c_path, monkeypatch):
    """Whether the token array is cut out first (C span finder) or the whole body is decoded,
    the request and its tokens come out the same; odd bodies take the whole-body decode."""
    if not c_path:
        monkeypatch.setattr(api, "_array_span", None)
    bodies = [
        b'{"token_ids": [1, 2, 3], "model": "m", "lora_name": "l", "account": true}',
        b'{"model": "m\\"token_ids\\": [9]", "token_ids": [4, 5]}',  # the key inside a string
        b'{"x": {"token_ids": [9]}, "token_ids": [6]}',  # nested first, then the real one
        b' { "token_ids" : [ 7 , 8 ] } ',
    ]
    for body in bodies:
        req, tokens = api.decode_route(body)
        full = decode(body, RouteRequest)
        assert (req.model, req.lora_name, req.account) == (full.model, full.lora_name, full.account)
        assert tokens is not None
        assert tokens.tokens() == json.loads(bytes(full.token_ids))
    # a key given twice is refused, both ways (a worker could read the other one)
    for body in (
        b'{"token_ids": [1], "token_ids": [2]}',
        b'{"token_ids": [1], "model": "a", "model": "b"}',
    ):
        with pytest.raises(BadRequest, match=r"duplicate key `(token_ids|model)`"):
            api.decode_route(body)
    # no top-level array: no tokens (the caller tokenizes the prompt or says what is missing)
    for body in (b'{"prompt": "x"}', b'{"x": {"token_ids": [1]}}', b'{"token_ids": null}'):
        assert api.decode_route(body)[1] is None


@pytest.mark.parametrize(
    ("fields", "bound"),
    [
        ({"max_tokens": 11}, 11),
        ({"max_completion_tokens": 7, "max_tokens": 11}, 7),  # vLLM's order
        ({}, None),
        # not an integer: forwarded as sent for the worker to judge, and no bound here
        ({"max_tokens": "11"}, None),
        ({"max_tokens": True}, None),
        ({"max_tokens": 11.5}, None),
        ({"max_completion_tokens": None, "max_tokens": 3}, 3),
    ],
)
def test_the_answers_bound_is_read_never_refused(fields, bound):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    assert decode(json.dumps(chat).encode(), api.ChatBody).output_bound() == bound
    if "max_completion_tokens" not in fields:
        completion = {"model": "m", "prompt": "hi", **fields}
        assert decode(json.dumps(completion).encode(), api.CompletionBody).output_bound() == bound
