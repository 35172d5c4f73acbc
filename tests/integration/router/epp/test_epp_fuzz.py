"""A fuzzer at the endpoint picker's door: random ext_proc streams over a real grpc.aio channel
(TLS, the default) against the real server. Each stream is a random sequence of messages —
request and response headers with random names, values, statuses, processing modes and subset
hints; bodies valid, truncated, binary or oversized; trailers; phases in any order; the bytes of
a message truncated, or garbage, through a raw call that serializes nothing — then a random end:
the client's half-close, a reset, or silence (the picker's own timeouts end it).

It asserts that the picker never fails (no stream closed as a bug: INTERNAL and a traceback),
that every stream ends with the picker's answers and a gRPC status within a bound, that the
server still serves a normal request afterwards, and that nothing is left in flight: no flight,
no load ticket, no stream. Seeded and bounded (a few seconds); ``KVROUTER_EPP_FUZZ_SEED`` picks
another seed, and a failure names the seed and the stream."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from epp_envoy import PROCESS, metric
from google.protobuf.struct_pb2 import Struct
from router_fakeworker import wait_for

from router.edge.epp.messages import endpoint_of

SEED = int(os.environ.get("KVROUTER_EPP_FUZZ_SEED", "37"))
STREAMS = 400
AT_ONCE = 50
#: how long one stream may take: the picker's timeouts below are shorter
STREAM_BOUND_S = 15.0
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/", "", "/v1/completions?x=1"]
#: the codes a stream may end with; INTERNAL only as the grpc.aio client's own (a write raced
#: the picker's close, :data:`CLIENT_INTERNAL`): the picker's INTERNAL is a bug
ENDED_WITH = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
}
#: the grpc.aio client's word for a write that failed because the call had ended
CLIENT_INTERNAL = "Internal error from Core"


def _text(rng: random.Random) -> str:
    pool = ["", "a", "fake-model", "x" * rng.randint(0, 300), "\x00\xff", "é✓", "1e309", "-1"]
    if rng.random() < 0.5:
        return rng.choice(pool)
    return "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 40)))


def _headers(rng: random.Random, *, response: bool) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    if response:
        status = rng.choice(["200", "200", "404", "500", "abc", "", "99999", "-5", "2" * 50])
        if rng.random() < 0.9:
            out.append((":status", status.encode()))
        ctype = rng.choice(["application/json", "text/event-stream", "", "x/y"])
        out.append(("content-type", ctype.encode()))
    else:
        if rng.random() < 0.9:
            out.append((":method", rng.choice([b"POST", b"POST", b"GET", b"", b"\xff"])))
        if rng.random() < 0.9:
            out.append((":path", rng.choice(PATHS).encode()))
        if rng.random() < 0.3:
            out.append(("x-request-id", _text(rng).encode("utf-8", "replace")))
        if rng.random() < 0.2:
            out.append(("authorization", b"Bearer " + rng.randbytes(rng.randint(0, 20))))
    for _ in range(rng.randint(0, 4)):
        out.append((_text(rng)[:30] or "k", _text(rng).encode("utf-8", "replace")))
    return out


def _body(rng: random.Random) -> bytes:
    good = json.dumps({"model": "fake-model", "prompt": _text(rng)}).encode()
    roll = rng.random()
    if roll < 0.4:
        return good
    if roll < 0.55:
        return good[: rng.randint(0, len(good))]  # truncated JSON
    if roll < 0.65:
        return json.dumps({"model": "fake-model", "messages": [{"role": "user"}]}).encode()
    if roll < 0.75:
        return b"x" * rng.choice([4097, 9000])  # over proxy.max_body_bytes below
    if roll < 0.85:
        return b""
    return rng.randbytes(rng.randint(1, 200))


def _message(rng: random.Random, phase: str) -> ProcessingRequest:
    m = ProcessingRequest()
    end = rng.random() < 0.5
    if phase in ("request_headers", "response_headers"):
        hm = HeaderMap(
            headers=[
                HeaderValue(key=k, raw_value=v)
                for k, v in _headers(rng, response=phase == "response_headers")
            ]
        )
        getattr(m, phase).CopyFrom(HttpHeaders(headers=hm, end_of_stream=end))
        if rng.random() < 0.2:
            modes = ProtocolConfiguration(
                request_body_mode=rng.randint(0, 5), response_body_mode=rng.randint(0, 5)
            )
            m.protocol_config.CopyFrom(modes)
        if rng.random() < 0.2:
            hint: Any = rng.choice([["127.0.0.1:1"], "a,b", 5, [1, None], {"x": "y"}, ""])
            s = Struct()
            s.update({"x-gateway-destination-endpoint-subset": hint})
            m.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    elif phase in ("request_body", "response_body"):
        getattr(m, phase).CopyFrom(HttpBody(body=_body(rng), end_of_stream=end))
    elif phase in ("request_trailers", "response_trailers"):
        getattr(m, phase).CopyFrom(HttpTrailers())
    return m  # (phase "empty": no field set)


PHASES = [
    "request_headers",
    "request_body",
    "request_trailers",
    "response_headers",
    "response_body",
    "response_trailers",
    "empty",
]


def _stream(rng: random.Random) -> tuple[list[bytes], str]:
    """One stream's messages (serialized, maybe broken) and how it ends: close, reset, silent."""
    out: list[bytes] = []
    if rng.random() < 0.6:  # mostly a plausible order, then anything
        plan = ["request_headers", "request_body", "response_headers", "response_body"]
        plan = plan[: rng.randint(1, 4)]
    else:
        plan = []
    plan += [rng.choice(PHASES) for _ in range(rng.randint(0, 5))]
    for phase in plan:
        data = _message(rng, phase).SerializeToString()
        roll = rng.random()
        if roll < 0.05:
            data = data[: rng.randint(0, max(0, len(data) - 1))]  # truncated
        elif roll < 0.1:
            data = rng.randbytes(rng.randint(1, 64))  # garbage
        out.append(data)
    return out, rng.choice(["close", "close", "reset", "silent"])


async def _run(channel: grpc.aio.Channel, messages: list[bytes], end: str) -> tuple[Any, str]:
    """Play one stream; (its final status code, its details). Reads run beside the writes."""
    call = channel.stream_stream(
        PROCESS, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )()
    answers: list[bytes] = []

    async def reader() -> None:
        while True:
            got = await call.read()
            if got is grpc.aio.EOF:
                return
            ProcessingResponse.FromString(got)  # every answer is a well-formed response
            answers.append(got)

    reading = asyncio.ensure_future(reader())
    try:
        for data in messages:
            if call.done():
                break
            await call.write(data)
        if end == "close" and not call.done():
            await call.done_writing()
        elif end == "reset":
            call.cancel()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the picker closed the stream first: its status is read below
    try:
        await reading
    except grpc.aio.AioRpcError:
        pass
    except asyncio.CancelledError:
        if end != "reset":
            raise
    code = await call.code()
    return code, (await call.details()) or ""


async def test_random_streams_never_break_the_picker_nor_leak_a_flight(workers, epp, http, caplog):
    caplog.set_level(logging.WARNING, logger="kvrouter.epp")
    a = await workers("a")
    r, envoy = await epp(
        [a],
        proxy={"max_body_bytes": 4096},
        epp={"stream_timeout_s": 0.5, "response_timeout_s": 0.5, "max_streams": 64},
    )
    rng = random.Random(SEED)
    plans = [_stream(rng) for _ in range(STREAMS)]
    codes: dict[str, int] = {}
    for start in range(0, STREAMS, AT_ONCE):
        batch = plans[start : start + AT_ONCE]
        runs = [asyncio.wait_for(_run(envoy.channel, m, e), STREAM_BOUND_S) for m, e in batch]
        for i, outcome in enumerate(await asyncio.gather(*runs, return_exceptions=True)):
            where = f"seed {SEED}, stream {start + i}: {batch[i]!r}"[:2000]
            assert not isinstance(outcome, BaseException), f"{where}: {outcome!r}"
            code, details = outcome
            assert code in ENDED_WITH, f"{where}: {code} {details}"
            if code == grpc.StatusCode.INTERNAL:
                assert details == CLIENT_INTERNAL, f"{where}: {details}"
            codes[code.name] = codes.get(code.name, 0) + 1
    print(f"seed {SEED}: {STREAMS} streams ended {codes}")
    assert len(codes) >= 3, codes  # (the fuzzer reaches more than one way to end)
    assert not [x for x in caplog.records if x.exc_info], "a stream failed with a traceback"
    # nothing left behind, and the picker still serves
    settled = lambda: (  # noqa: E731
        r.state.placer.inflight == 0 and r.app.state.epp.streams == 0
    )
    await wait_for(settled, 10, "every stream and flight ended")
    assert not r.state.placer.load.items()
    body = json.dumps({"model": "fake-model", "prompt": "after the storm"}).encode()
    p = await envoy.pick("/v1/completions", body)
    assert p.endpoint == endpoint_of(a.url)
    p.call.cancel()
    await wait_for(settled, 10, "the last one ended")
    text = (await http.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_epp_streams") == 0
    picks = metric(text, "kvrouter_route_decisions_total", kind="epp")
    print(f"picks {picks}, refused {metric(text, 'kvrouter_rejected_requests_total')}")
    assert picks >= 20  # (streams reach the answer's phase, where the flights are)
    assert metric(text, "kvrouter_inflight_requests", worker="a") == 0
