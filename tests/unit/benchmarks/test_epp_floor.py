"""``benchmarks/epp_floor.py``: both floors (grpc.aio, and gRPC's framing on h2) are pickers a
real gRPC client talks to as Envoy does, and answer the same messages — else the floors that
``bench_epp.py --floor-transport`` compares would not measure the same work."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc", reason="the epp extra")
pytest.importorskip("h2", reason="the h2 floor")

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue  # noqa: E402
from envoy.service.ext_proc.v3.external_processor_pb2 import (  # noqa: E402
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

FLOOR = Path(__file__).resolve().parents[3] / "benchmarks" / "epp_floor.py"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ENDPOINT = "10.1.2.3:8000"


@pytest.fixture(params=["grpc", "h2"])
async def floor(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(FLOOR), "--endpoint", ENDPOINT, "--transport", request.param,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        m = re.search(r"EPP listening on ([\d.]+:\d+)", line)
        assert m, line
        yield m.group(1)
    finally:
        proc.kill()
        await proc.wait()


def headers(end: bool, *, response: bool = False) -> ProcessingRequest:
    hm = HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/v1/completions")])
    h = HttpHeaders(headers=hm, end_of_stream=end)
    return (
        ProcessingRequest(response_headers=h) if response else ProcessingRequest(request_headers=h)
    )


def body(data: bytes, *, response: bool = False) -> ProcessingRequest:
    b = HttpBody(body=data, end_of_stream=True)
    return ProcessingRequest(response_body=b) if response else ProcessingRequest(request_body=b)


async def test_a_floor_picks_echoes_and_answers_health_as_a_grpc_server(floor: str) -> None:
    async with grpc.aio.insecure_channel(floor) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        got = await asyncio.wait_for(check(health_pb2.HealthCheckRequest(service="")), 10)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        call = channel.stream_stream(
            PROCESS,
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )()
        await call.write(headers(False))
        await call.write(body(b'{"prompt": "hi"}'))
        pick = await asyncio.wait_for(call.read(), 10)
        mutation = pick.request_headers.response.header_mutation.set_headers
        assert [(h.header.key, h.header.raw_value) for h in mutation] == [
            ("x-gateway-destination-endpoint", ENDPOINT.encode())
        ]
        assert pick.request_headers.response.clear_route_cache
        lb = pick.dynamic_metadata.fields["envoy.lb"].struct_value
        assert lb.fields["x-gateway-destination-endpoint"].string_value == ENDPOINT
        echo = await call.read()
        assert (
            echo.request_body.response.body_mutation.streamed_response.body == b'{"prompt": "hi"}'
        )
        await call.write(headers(False, response=True))
        assert (await call.read()).HasField("response_headers")
        await call.write(body(b"data: [DONE]\n\n", response=True))
        answer = (await call.read()).response_body.response.body_mutation.streamed_response
        assert (answer.body, answer.end_of_stream) == (b"data: [DONE]\n\n", True)
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
