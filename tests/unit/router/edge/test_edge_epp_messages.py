"""The endpoint picker's pure parts: reading Envoy's ext_proc messages (headers, the subset hint,
the endpoint served) and the shape of every answer it builds (router.edge.epp.messages), and the
``epp:`` settings."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="the epp extra")

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpHeaders, ProcessingResponse
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from router.edge.epp import messages as m
from router.errors import ConfigError
from router.settings import load_settings


def parse(reply: bytes) -> ProcessingResponse:
    """A built answer (serialized, as the server writes it) read back."""
    return ProcessingResponse.FromString(reply)


def hint(value: object, ns: str = m.SUBSET_NS, key: str = m.SUBSET) -> Metadata:
    meta = Metadata()
    s = Struct()
    s.update({key: value})
    meta.filter_metadata[ns].CopyFrom(s)
    return meta


def test_header_map_prefers_raw_value_and_lowercases_names() -> None:
    hm = HeaderMap(
        headers=[
            HeaderValue(key=":path", raw_value=b"/v1/completions"),
            HeaderValue(key="X-Request-Id", value="from-value"),
            HeaderValue(key="authorization", raw_value=b"Bearer \xe9", value="ignored"),
        ]
    )
    h = m.header_map(HttpHeaders(headers=hm))
    assert h == {
        ":path": "/v1/completions",
        "x-request-id": "from-value",
        "authorization": "Bearer \xe9",  # one char per byte
    }
    some = m.header_map(HttpHeaders(headers=hm), frozenset({":path", "x-request-id", "other"}))
    assert some == {":path": "/v1/completions", "x-request-id": "from-value"}


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("http://10.0.0.7:8000", "10.0.0.7:8000"),
        ("http://10.0.0.7:8000/v1/", "10.0.0.7:8000"),
        ("http://10.0.0.7", "10.0.0.7:80"),
        ("https://10.0.0.7", "10.0.0.7:443"),
        ("http://[FD00::7]:8000", "[fd00::7]:8000"),
        ("http://Engine-0.svc:8001", "engine-0.svc:8001"),
    ],
)
def test_endpoint_of_a_worker_url(url: str, endpoint: str) -> None:
    assert m.endpoint_of(url) == endpoint


def test_subset_hint_reads_lists_comma_strings_and_bare_hosts() -> None:
    assert m.subset_hint(Metadata()) is None  # no hint: any endpoint
    assert m.subset_hint(hint("10.0.0.1:80", key="other")) is None
    assert m.subset_hint(hint([])) == frozenset()  # a hint of none: 503
    assert m.subset_hint(hint("")) == frozenset()
    assert m.subset_hint(hint(5)) == frozenset()  # not a string: nothing allowed
    got = m.subset_hint(hint(["10.0.0.1:80", " 10.0.0.2:81,10.0.0.3 ", 7, "[FD00::1]:9"]))
    assert got == {"10.0.0.1:80", "10.0.0.2:81", "10.0.0.3", "[fd00::1]:9"}
    assert m.subset_hint(hint("10.0.0.1:80,fd00::2")) == {"10.0.0.1:80", "[fd00::2]"}
    subset = m.subset_hint(hint("10.0.0.1:80,10.0.0.3,[fd00::2]"))
    assert subset is not None
    assert m.in_subset("10.0.0.1:80", subset)
    assert not m.in_subset("10.0.0.1:81", subset)  # another port of a listed endpoint
    assert m.in_subset("10.0.0.3:9000", subset)  # a bare host: any port of it
    assert m.in_subset("[fd00::2]:8000", subset)
    assert not m.in_subset("10.0.0.30:80", subset)


def test_served_endpoint() -> None:
    assert m.served_endpoint(Metadata()) is None
    meta = hint("10.0.0.9:8000", ns=m.DESTINATION_NS, key=m.SERVED)
    assert m.served_endpoint(meta) == "10.0.0.9:8000"


def test_picked_puts_the_pick_in_the_header_and_the_fallbacks_in_the_metadata() -> None:
    r = parse(
        m.picked(["10.0.0.1:80", "10.0.0.2:80"], [("x-data-parallel-rank", "1")], ["authorization"])
    )
    assert r.WhichOneof("response") == "request_headers"
    common = r.request_headers.response
    assert common.clear_route_cache
    sets = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    # one ip:port in the header: Envoy's ORIGINAL_DST cluster reads no list there
    assert sets == {m.DESTINATION: b"10.0.0.1:80", "x-data-parallel-rank": b"1"}
    assert all(
        h.append_action == h.OVERWRITE_IF_EXISTS_OR_ADD for h in common.header_mutation.set_headers
    )
    assert list(common.header_mutation.remove_headers) == ["authorization"]
    assert MessageToDict(r.dynamic_metadata) == {
        "envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.1:80,10.0.0.2:80"}
    }
    # the metadata is serialized once per endpoint list: another pick, another list, its own
    again = parse(m.picked(["10.0.0.2:80"], [], []))
    assert again.request_headers.response.header_mutation.set_headers[0].header.raw_value == (
        b"10.0.0.2:80"
    )
    assert MessageToDict(again.dynamic_metadata) == {
        "envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.2:80"}
    }
    assert not again.request_headers.response.header_mutation.remove_headers


def test_body_chunks_headers_and_trailers_replies() -> None:
    r = parse(m.body_chunk(b"abc", True, request=True))
    sr = r.request_body.response.body_mutation.streamed_response
    assert (sr.body, sr.end_of_stream) == (b"abc", True)
    # an empty chunk is still a streamed body answer (Envoy waits for one per chunk it sent)
    r = parse(m.body_chunk(b"", False, request=False))
    assert r.WhichOneof("response") == "response_body"
    assert r.response_body.response.body_mutation.WhichOneof("mutation") == "streamed_response"
    r = parse(m.headers_reply(request=False, set_headers=[("x-kvrouter-worker", "a")]))
    assert r.response_headers.response.header_mutation.set_headers[0].header.raw_value == b"a"
    bare = parse(m.headers_reply(request=True))
    assert bare.WhichOneof("response") == "request_headers"
    assert not bare.request_headers.HasField("response")
    assert parse(m.headers_reply(request=False)).WhichOneof("response") == "response_headers"
    assert parse(m.trailers_reply(request=True)).WhichOneof("response") == "request_trailers"
    assert parse(m.trailers_reply(request=False)).WhichOneof("response") == "response_trailers"


def test_immediate_is_the_openai_error_shape() -> None:
    im = parse(m.immediate(429, "too many", "rate_limit_error", [("x-request-id", "r1")]))
    im = im.immediate_response
    assert im.status.code == 429 and im.details == "kvrouter_epp_429"
    heads = {h.header.key: h.header.raw_value for h in im.headers.set_headers}
    assert heads == {"content-type": b"application/json", "x-request-id": b"r1"}
    assert json.loads(im.body) == {
        "error": {"message": "too many", "type": "rate_limit_error", "param": None, "code": None}
    }
    slow = parse(m.immediate(408, "slow", "invalid_request_error"))
    assert slow.immediate_response.status.code == 408


def test_epp_settings(tmp_path) -> None:
    assert load_settings(environ={}).epp.port is None  # off by default
    s = load_settings(environ={"KVROUTER_EPP__PORT": "9002", "KVROUTER_EPP__HOST": "0.0.0.0"})
    assert (s.epp.port, s.epp.host) == (9002, "0.0.0.0")
    with pytest.raises(ConfigError, match=r"epp\.port"):
        load_settings(environ={"KVROUTER_EPP__PORT": "70000"})
    crt = tmp_path / "c.pem"
    crt.write_text("x")
    with pytest.raises(ConfigError, match=r"epp\.tls_cert: needs tls_key"):
        load_settings(environ={}, overrides={"epp": {"tls_cert": str(crt)}})
    with pytest.raises(ConfigError, match=r"epp\.tls_key: must be a readable PEM file"):
        load_settings(
            environ={}, overrides={"epp": {"tls_cert": str(crt), "tls_key": str(tmp_path / "no")}}
        )
    for key, bad in (("max_streams", 0), ("stream_timeout_s", 0), ("fallbacks", 17)):
        with pytest.raises(ConfigError, match=rf"epp\.{key}"):
            load_settings(environ={}, overrides={"epp": {key: bad}})
