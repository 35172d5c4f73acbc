"""Envoy's side of the endpoint picker protocol, for the EPP's tests: a real ``grpc.aio`` client
of ``ExternalProcessor/Process`` that sends what Envoy's ext_proc filter sends (request headers,
body chunks, trailers; FULL_DUPLEX_STREAMED) and, like Envoy, forwards the request to the endpoint
picked (over real HTTP, to the fake worker) and streams the answer back through the picker."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import httpx
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
)
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "PROCESS",
    "Envoy",
    "Picked",
    "body_request",
    "headers_request",
    "metric",
    "served_certificate",
]

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels``, in a /metrics text."""
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def served_certificate(port: int, host: str = "127.0.0.1") -> bytes:
    """The certificate the picker serves on ``port`` (PEM), read off a real TLS handshake that
    verifies nothing: what a test client then trusts, as Envoy is told to with a CA."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    _reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    return ssl.DER_cert_to_PEM_cert(der).encode()


def headers_request(
    headers: Iterable[tuple[str, str]],
    *,
    end: bool = False,
    subset: Any = None,
    response: bool = False,
) -> ProcessingRequest:
    """Request (or response) headers as Envoy sends them (``raw_value``), with the subset hint
    (a list or a comma string) in the filter metadata when given."""
    hm = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])
    meta = Metadata()
    if subset is not None:
        s = Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        meta.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    h = HttpHeaders(headers=hm, end_of_stream=end)
    if response:
        return ProcessingRequest(response_headers=h, metadata_context=meta)
    return ProcessingRequest(request_headers=h, metadata_context=meta)


def body_request(data: bytes, end: bool, *, response: bool = False) -> ProcessingRequest:
    b = HttpBody(body=data, end_of_stream=end)
    return ProcessingRequest(response_body=b) if response else ProcessingRequest(request_body=b)


class Picked:
    """What the picker answered for one request: the pick (or an immediate response), the body
    it passed back, and the open stream for the response phase."""

    def __init__(self, call: Any, first: ProcessingResponse) -> None:
        self.call = call
        self.first = first
        self.body = b""
        self.body_messages = 0
        self.trailers: ProcessingResponse | None = None

    @property
    def immediate(self) -> Any:
        return self.first.immediate_response if self.first.HasField("immediate_response") else None

    @property
    def set_headers(self) -> dict[str, str]:
        common = self.first.request_headers.response
        return {
            h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
        }

    @property
    def removed(self) -> list[str]:
        return list(self.first.request_headers.response.header_mutation.remove_headers)

    @property
    def endpoint(self) -> str:
        return self.set_headers["x-gateway-destination-endpoint"]

    @property
    def metadata(self) -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(self.first.dynamic_metadata)

    async def forward(
        self, http: httpx.AsyncClient, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, list[ProcessingResponse]]:
        """Envoy's part after the pick: the request to the endpoint picked, its answer streamed
        back through the picker chunk by chunk (each echo read before the next chunk)."""
        sent = {**headers, **{k: v for k, v in self.set_headers.items()}}
        sent = {k: v for k, v in sent.items() if k not in self.removed and not k.startswith(":")}
        url = f"http://{self.endpoint}{path}"
        echoes: list[ProcessingResponse] = []
        received = b""
        async with http.stream("POST", url, content=body, headers=sent) as resp:
            head = [(":status", str(resp.status_code))]
            head += [(k, v) for k, v in resp.headers.items()]
            await self.call.write(headers_request(head, response=True))
            echoes.append(await self.call.read())
            async for chunk in resp.aiter_raw():
                await self.call.write(body_request(chunk, False, response=True))
                echo = await self.call.read()
                echoes.append(echo)
                received += echo.response_body.response.body_mutation.streamed_response.body
            await self.call.write(body_request(b"", True, response=True))
            echoes.append(await self.call.read())
        return resp.status_code, received, echoes


class Envoy:
    """A channel to the picker (``creds``: TLS) and the streams Envoy would open on it: one
    connection of its own (gRPC would otherwise share one among channels to one address)."""

    def __init__(
        self, port: int, *, creds: grpc.ChannelCredentials | None = None, host: str = "127.0.0.1"
    ) -> None:
        target = f"{host}:{port}"
        options = [("grpc.use_local_subchannel_pool", 1)]
        if creds is None:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self.channel = grpc.aio.secure_channel(target, creds, options=options)
        self.creds = creds

    def another(self, port: int) -> Envoy:
        """A second connection to the same picker, with the same credentials."""
        return Envoy(port, creds=self.creds)

    async def aclose(self) -> None:
        await self.channel.close()

    def open(self) -> Any:
        """A new ext_proc stream (raw: the test writes and reads ProcessingRequest/Response)."""
        return self.channel.stream_stream(
            PROCESS,
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )()

    async def pick(
        self,
        path: str,
        body: bytes | None,
        *,
        method: str = "POST",
        headers: Sequence[tuple[str, str]] = (),
        chunk: int = 16384,
        subset: Any = None,
        trailers: bool = False,
    ) -> Picked:
        """Send one request's headers and body (``None``: bodiless) and read the picker's
        answers to them: the first, then the body's echo until its end, then the trailers'."""
        call = self.open()
        head = [(":method", method), (":path", path), (":authority", "gw"), *headers]
        await call.write(headers_request(head, end=body is None, subset=subset))
        # the first answer is read while the body goes out, and sending stops once it came or
        # the stream ended: the picker may answer before the body's end (413) and close the
        # stream. (A read started only after a grpc.aio client's write failed would lose that
        # answer: the failed write fails the whole call.)
        first = asyncio.ensure_future(call.read())
        if body is not None:
            pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
            messages = [
                body_request(p, n == len(pieces) - 1 and not trailers) for n, p in enumerate(pieces)
            ]
            if trailers:
                messages.append(ProcessingRequest(request_trailers=HttpTrailers()))
            for m in messages:
                if first.done():
                    break
                try:
                    await call.write(m)
                except grpc.aio.AioRpcError:
                    break
        p = Picked(call, await first)
        if p.immediate is not None or body is None:
            return p
        while True:
            m = await call.read()
            if m.HasField("request_trailers"):
                p.trailers = m
                break
            assert m.HasField("request_body"), m
            sr = m.request_body.response.body_mutation.streamed_response
            p.body += sr.body
            p.body_messages += 1
            if sr.end_of_stream:
                if trailers:
                    continue
                break
        return p

    async def health(self, service: str) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return int(r.status)

    async def wait_health(self, service: str, status: int, timeout: float = 10.0) -> None:
        """Until ``service`` answers ``status`` (the picker re-reads readiness every 0.5 s);
        fail after ``timeout`` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (got := await self.health(service)) != status:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"health {service!r} is {got}, not {status}")
            await asyncio.sleep(0.02)
