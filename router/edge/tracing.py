"""OpenTelemetry traces, when ``tracing.otlp_endpoint`` is set (the optional ``otel`` extra).

One server span per request from OpenTelemetry's own ASGI middleware, outermost, exported over
OTLP/HTTP in batches from a background thread. The span carries the routing decision through the
response headers it records (``x-kvrouter-worker``, ``x-kvrouter-matched-blocks``,
``x-request-id``); the proxy passes the span's context to the worker as ``traceparent`` so the
worker's spans join the trace. Per-chunk ``send``/``receive`` spans are off: a stream of a
thousand tokens would otherwise make a thousand spans. Off (the default), nothing is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.errors import ConfigError
from router.settings import TracingSettings

__all__ = ["Tracing", "inject_trace_headers"]

#: response headers recorded on the server span (the decision and the request id)
RECORDED_HEADERS = [
    "x-kvrouter-worker",
    "x-kvrouter-matched-blocks",
    "x-kvrouter-cached-blocks",
    "x-request-id",
]


class Tracing:
    """The tracer provider and the ASGI middleware to add; ``shutdown`` flushes what is queued."""

    def __init__(self, settings: TracingSettings) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        except ImportError as e:
            if "InstrumentationScope" in str(e):
                # xds-protos (the epp extra) ships its own, older copy of opentelemetry's protos
                # into the same package directory: whichever pip unpacks last wins
                raise ConfigError(
                    "invalid config: tracing needs opentelemetry-proto's own files, which "
                    "xds-protos (the epp extra) overwrote: pip install --force-reinstall "
                    "--no-deps opentelemetry-proto"
                ) from e
            raise ConfigError(
                "invalid config: tracing.otlp_endpoint needs the otel extra: "
                "pip install -e '.[otel]' in the kvrouter checkout"
            ) from e
        assert settings.otlp_endpoint is not None
        endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=settings.export_timeout_s)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=settings.batch_delay_s * 1000)
        )

    def middleware(self) -> tuple[Any, dict[str, Any]]:
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        return OpenTelemetryMiddleware, {
            "tracer_provider": self.provider,
            "http_capture_headers_server_response": RECORDED_HEADERS,
            "exclude_spans": ["receive", "send"],
        }

    def shutdown(self) -> None:
        self.provider.shutdown()


def inject_trace_headers() -> Callable[[], list[tuple[str, str]]]:
    """A function giving the current span's ``traceparent``/``tracestate`` as headers."""
    from opentelemetry.propagate import inject

    def headers() -> list[tuple[str, str]]:
        carrier: dict[str, str] = {}
        inject(carrier)
        return list(carrier.items())

    return headers
