"""What the endpoint picker refuses, and how: an ``ImmediateResponse`` in OpenAI's error shape
for the client's errors (400, 401, 404, 408, 413, 429, 503), a gRPC status for a stream that is
not ext_proc (malformed, out of order); and a stream reset at any point leaves no load ticket and
no in-flight count behind. Real router, real gRPC client (see ``epp_envoy``)."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProtocolConfiguration,
)
from epp_envoy import body_request, headers_request, metric
from router_fakeworker import wait_for

from router.edge.epp.messages import endpoint_of

JSON = {"content-type": "application/json"}


def completion(prompt: str, **extra: object) -> bytes:
    return json.dumps({"model": "fake-model", "prompt": prompt, **extra}).encode()


def error_of(p) -> tuple[int, dict]:
    im = p.immediate
    assert im is not None, p.first
    heads = {h.header.key: h.header.raw_value for h in im.headers.set_headers}
    assert heads["content-type"] == b"application/json"
    return im.status.code, json.loads(im.body)["error"]


async def test_a_bad_body_is_400_an_unknown_model_404(workers, epp, http):
    a = await workers("a")
    r, envoy = await epp([], workers=[a.spec(model="fake-model")])
    status, err = error_of(await envoy.pick("/v1/completions", b"{not json"))
    assert status == 400 and err["type"] == "invalid_request_error"
    status, err = error_of(await envoy.pick("/v1/chat/completions", b'{"model": "fake-model"}'))
    assert status == 400 and "messages" in err["message"]
    status, err = error_of(await envoy.pick("/v1/completions", completion("x", model="nope")))
    assert status == 404 and err["type"] == "not_found_error"
    assert r.state.placer.inflight == 0 and not a.requests
    text = (await http.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_rejected_requests_total", status="400") == 2


async def test_the_api_keys_are_checked_and_never_reach_the_worker(workers, epp):
    a = await workers("a")
    r, envoy = await epp([a], api_keys=["sekrit"])
    status, err = error_of(await envoy.pick("/v1/completions", completion("x")))
    assert status == 401 and err["type"] == "authentication_error"
    auth = [("authorization", "Bearer sekrit")]
    p = await envoy.pick("/v1/completions", completion("x"), headers=auth)
    assert p.endpoint == endpoint_of(a.url) and "authorization" in p.removed
    p.call.cancel()
    await wait_for(lambda: r.state.placer.inflight == 0, 10)


async def test_past_max_inflight_is_429_until_a_flight_ends(workers, epp):
    a = await workers("a")
    r, envoy = await epp([a], proxy={"max_inflight": 1})
    held = await envoy.pick("/v1/completions", completion("one"))
    assert held.immediate is None
    status, err = error_of(await envoy.pick("/v1/completions", completion("two")))
    assert status == 429 and err["type"] == "rate_limit_error"
    await held.call.write(headers_request([(":status", "200")], end=True, response=True))
    await held.call.read()
    await wait_for(lambda: r.state.placer.inflight == 0, 10)
    again = await envoy.pick("/v1/completions", completion("three"))
    assert again.immediate is None
    again.call.cancel()


async def test_an_oversized_body_is_413_and_a_slow_one_408(workers, epp):
    a = await workers("a")
    r, envoy = await epp([a], proxy={"max_body_bytes": 2048}, epp={"stream_timeout_s": 0.3})
    status, _ = error_of(await envoy.pick("/v1/completions", completion("x" * 5000), chunk=1024))
    assert status == 413
    call = envoy.open()  # headers, then no body within epp.stream_timeout_s
    await call.write(headers_request([(":method", "POST"), (":path", "/v1/completions")]))
    first = await asyncio.wait_for(call.read(), 10)
    assert first.immediate_response.status.code == 408
    assert r.state.placer.inflight == 0 and r.state.placer.load.inflight("a") == 0


async def test_past_max_streams_one_connection_waits_another_is_429(workers, epp, http):
    """One connection carries at most epp.max_streams streams (HTTP/2's
    MAX_CONCURRENT_STREAMS): its next one waits in the client, then is served. Another
    connection's stream past the limit is answered 429, counted (reason max_streams)."""
    a = await workers("a")
    r, envoy = await epp([a], epp={"max_streams": 1})
    open_one = envoy.open()
    await open_one.write(headers_request([(":method", "POST"), (":path", "/v1/completions")]))
    await wait_for(lambda: _streams(r) == 1, 10, "one stream")
    waiting = asyncio.ensure_future(envoy.pick("/v1/completions", completion("queued")))
    other = envoy.another(r.app.state.epp_port)
    try:
        status, err = error_of(await other.pick("/v1/completions", completion("x")))
        assert status == 429 and "max_streams" in err["message"]
        assert not waiting.done()  # (behind the first, in its connection's client)
        open_one.cancel()
        served = await asyncio.wait_for(waiting, 10)
        assert served.immediate is None and served.endpoint == endpoint_of(a.url)
        served.call.cancel()
    finally:
        await other.aclose()
    await wait_for(lambda: _streams(r) == 0, 10, "the streams closed")
    text = (await http.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_epp_streams_refused_total", reason="max_streams") == 1
    assert metric(text, "kvrouter_epp_streams") == 0


def _streams(r) -> int:
    return r.app.state.epp.streams  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "first",
    [
        ProcessingRequest(response_headers=headers_request([(":status", "200")]).request_headers),
        body_request(b"{}", True),
        ProcessingRequest(),
    ],
    ids=["response-first", "body-first", "empty"],
)
async def test_out_of_order_phases_close_the_stream_invalid_argument(workers, epp, first, caplog):
    a = await workers("a")
    _r, envoy = await epp([a])
    call = envoy.open()
    await call.write(first)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not [x for x in caplog.records if x.name.startswith("grpc") and x.levelno >= 30]


async def test_a_phase_after_the_pick_out_of_order_ends_the_flight(workers, epp, http):
    a = await workers("a")
    r, envoy = await epp([a])
    p = await envoy.pick("/v1/completions", completion("x"))
    await p.call.write(body_request(b"body before headers", False, response=True))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await p.call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await wait_for(lambda: r.state.placer.inflight == 0, 10)
    assert r.state.placer.load.inflight("a") == 0
    text = (await http.get(r.url + "/metrics")).text
    labels = {"worker": "a", "status": "protocol_error"}
    assert metric(text, "kvrouter_proxied_requests_total", **labels) == 1


async def test_a_malformed_message_is_invalid_argument_without_grpc_logging(workers, epp, caplog):
    a = await workers("a")
    _r, envoy = await epp([a])
    raw = envoy.channel.stream_stream(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )()
    caplog.set_level(logging.DEBUG, logger="grpc")
    await raw.write(b"\xff\xff\xff\xff not a protobuf")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await raw.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a ProcessingRequest" in (e.value.details() or "")
    assert not [x for x in caplog.records if x.name.startswith("grpc") and x.levelno >= 30]


async def test_a_buffered_body_mode_is_refused_failed_precondition(workers, epp):
    a = await workers("a")
    _r, envoy = await epp([a])
    call = envoy.open()
    m = headers_request([(":method", "POST"), (":path", "/v1/completions")])
    m.protocol_config.CopyFrom(ProtocolConfiguration(request_body_mode=2))  # BUFFERED
    await call.write(m)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_reset_mid_body_leaves_nothing_behind(workers, epp):
    a = await workers("a")
    r, envoy = await epp([a])
    call = envoy.open()
    await call.write(headers_request([(":method", "POST"), (":path", "/v1/completions")]))
    await call.write(body_request(b'{"model": "fake-model", "pro', False))
    await wait_for(lambda: _streams(r) == 1, 10, "the stream served")
    call.cancel()
    await wait_for(lambda: _streams(r) == 0, 10, "the stream ended")
    assert r.state.placer.inflight == 0 and not r.state.placer.load.items()


async def test_a_reset_mid_response_ends_the_flight_once(workers, epp, http):
    a = await workers("a", chunks=50, chunk_delay_s=0.02)
    r, envoy = await epp([a])
    body = completion("stream me", stream=True)
    p = await envoy.pick("/v1/completions", body)
    assert r.state.placer.load.inflight("a") == 1
    async with http.stream("POST", f"http://{p.endpoint}/v1/completions", content=body) as resp:
        await p.call.write(headers_request([(":status", "200")], response=True))
        await p.call.read()
        async for chunk in resp.aiter_raw():
            await p.call.write(body_request(chunk, False, response=True))
            await p.call.read()
            break
        p.call.cancel()  # Envoy resets the stream mid-answer
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "the flight ended")
    assert r.state.placer.load.inflight("a") == 0 and not r.state.placer.load.items()
    text = (await http.get(r.url + "/metrics")).text
    labels = {"worker": "a", "status": "client_disconnect"}
    assert metric(text, "kvrouter_proxied_requests_total", **labels) == 1
    assert metric(text, "kvrouter_proxied_requests_total", worker="a") == 1  # once
    assert metric(text, "kvrouter_inflight_requests", worker="a") == 0
    assert metric(text, "kvrouter_time_to_first_byte_seconds_count", worker="a") == 1


async def test_with_the_answer_s_body_off_its_head_is_the_first_byte_its_close_the_end(
    workers, epp, http
):
    """response_body_mode NONE: no response chunk comes. The head is timed as the first byte,
    but the prefill ends only when the worker's events show the prompt stored (vLLM
    send the head at once); Envoy closing its side after the head ends the flight with the
    head's status."""
    a = await workers("a")
    r, envoy = await epp([a])
    call = envoy.open()
    m = headers_request([(":method", "POST"), (":path", "/v1/completions"), (":authority", "gw")])
    modes = ProtocolConfiguration(request_body_mode=4, response_body_mode=0)  # FULL_DUPLEX, NONE
    m.protocol_config.CopyFrom(modes)
    await call.write(m)
    prompt = "head only, with four blocks of prompt to build at the worker:" + "." * 3
    assert len(prompt) == 64  # (the byte tokenizer: a token a byte, 16 a block)
    await call.write(body_request(completion(prompt), True))
    pick = await call.read()
    assert pick.HasField("request_headers")
    await call.read()  # the body's echo
    assert r.state.placer.load.inflight("a") == 1
    head = [(":status", "200"), ("content-type", "application/json")]
    await call.write(headers_request(head, response=True))
    await call.read()
    load = r.state.placer.load.get(("a", 0))
    assert load is not None and load.inflight_prefill == 4  # the head says nothing of it
    a.store(list(prompt.encode()))  # the worker's events: the prompt is built
    await wait_for(lambda: load.inflight_prefill == 0, 10, "the prefill ended by the events")
    assert r.state.placer.load.inflight("a") == 1
    await call.done_writing()  # Envoy closes its side at the answer's end
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "the flight ended")
    text = (await http.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_proxied_requests_total", worker="a", status="200") == 1
    assert metric(text, "kvrouter_proxied_requests_total", worker="a") == 1
    assert metric(text, "kvrouter_time_to_first_byte_seconds_count", worker="a") == 1


async def test_an_envoy_silent_after_the_pick_ends_its_stream_and_flight(workers, epp, http):
    """Issue 37, 4: a connection that went silent after the pick (a stalled or partitioned
    Envoy) held its flights for good, until max_inflight made every proxied request 429. Each
    message of the answer's phase must come within epp.response_timeout_s of the one before."""
    a = await workers("a")
    r, envoy = await epp([a], epp={"response_timeout_s": 0.5})
    held = [await envoy.pick("/v1/completions", completion(f"x{i}")) for i in range(3)]
    assert all(p.endpoint == endpoint_of(a.url) for p in held)
    assert r.state.placer.inflight == 3  # picked, and Envoy says nothing more
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "the silent streams ended")
    assert not r.state.placer.load.items()
    text = (await http.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_proxied_requests_total", status="timeout") == 3
    # a stream that keeps talking is not cut: its answer goes through whole
    p = await envoy.pick("/v1/completions", completion("y"))
    status, _, _ = await p.forward(http, "/v1/completions", completion("y"), JSON)
    assert status == 200
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "answered")
    for q in held:
        q.call.cancel()
