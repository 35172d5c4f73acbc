"""OpenTelemetry traces (``tracing.otlp_endpoint``, the ``otel`` extra) reach a collector.

The collector is the one seam faked here: a real HTTP server on 127.0.0.1 speaking OTLP/HTTP's
receiving side (``POST /v1/traces``, protobuf ``ExportTraceServiceRequest`` decoded with the
OpenTelemetry proto package); no OpenTelemetry Collector binary runs on this machine. Everything
else is real: the SDK's batch exporter, the ASGI middleware, the router and a worker over HTTP.
"""

from __future__ import annotations

import pytest
from router_fakeworker import ServerHandle, wait_for
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class Collector:
    def __init__(self) -> None:
        self.spans: list[dict] = []

        async def traces(request: Request) -> Response:
            req = ExportTraceServiceRequest.FromString(await request.body())
            for rs in req.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        attrs = {}
                        for a in span.attributes:
                            v = a.value
                            if v.HasField("array_value"):
                                attrs[a.key] = [x.string_value for x in v.array_value.values]
                            else:
                                attrs[a.key] = v.string_value or v.int_value
                        self.spans.append(
                            {
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "attrs": attrs,
                                "service": service.get("service.name"),
                            }
                        )
            return Response(b"", media_type="application/x-protobuf")

        self.app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])


async def test_a_proxied_request_is_one_span_with_its_decision(workers, router, http) -> None:
    collector = Collector()
    server = await ServerHandle(collector.app).start()
    try:
        a = await workers("a")
        tracing = {"otlp_endpoint": server.url, "service_name": "kvr-test", "batch_delay_s": 0.2}
        r = await router([a], tracing=tracing)
        parent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
        resp = await http.post(
            r.url + "/v1/completions",
            json={"model": "fake-model", "prompt": "hello there", "max_tokens": 2},
            headers={"traceparent": parent, "x-request-id": "req-42"},
        )
        assert resp.status_code == 200 and resp.headers["x-kvrouter-worker"] == "a"

        def exported() -> list[dict]:
            return [s for s in collector.spans if s["trace_id"] == TRACE_ID]

        await wait_for(exported, 20, "the request's span at the collector")
        (span,) = exported()  # one span per request: no per-chunk send/receive spans
        assert span["service"] == "kvr-test"
        assert span["attrs"]["http.response.header.x_kvrouter_worker"] == ["a"]
        assert span["attrs"]["http.response.header.x_request_id"] == ["req-42"]
        # the worker got the router's span as its parent, in the client's trace
        sent = a.request_headers[-1]["traceparent"]
        assert sent.split("-")[1] == TRACE_ID and sent.split("-")[2] == span["span_id"]
    finally:
        await server.stop()


def test_tracing_settings_are_checked() -> None:
    from router.errors import ConfigError
    from router.settings import load_settings

    with pytest.raises(ConfigError, match="otlp_endpoint"):
        load_settings(environ={}, overrides={"tracing": {"otlp_endpoint": "collector:4318"}})
    with pytest.raises(ConfigError, match="sample_ratio"):
        load_settings(environ={}, overrides={"tracing": {"sample_ratio": 2}})
