"""The ext_proc messages of the endpoint picker protocol (Gateway API Inference Extension,
proposal 004): reading what Envoy sends (headers, the subset hint, the endpoint served) and
building every :class:`ProcessingResponse` the picker answers. Pure functions on the protobuf
types of ``xds-protos``; no gRPC here.

- the pick: ``x-gateway-destination-endpoint: ip:port`` as a request header *and* as dynamic
  metadata ``{"envoy.lb": {"x-gateway-destination-endpoint": "ip:port"}}`` (the protocol forbids
  the two to differ), with ``clear_route_cache`` so Envoy routes on the new header. Fallbacks, when
  configured, follow the protocol (v0.4+): the same key holds ``primary,next,...``;
- bodies are echoed as ``StreamedBodyResponse`` chunks (the FULL_DUPLEX_STREAMED body mode);
- an error before the pick is an ``ImmediateResponse`` with the OpenAI error body of
  :func:`router.errors.error_json`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from router.errors import error_json

__all__ = [
    "DESTINATION",
    "DESTINATION_NS",
    "SERVED",
    "SUBSET",
    "SUBSET_NS",
    "body_chunk",
    "endpoint_of",
    "header_map",
    "headers_reply",
    "immediate",
    "in_subset",
    "picked",
    "served_endpoint",
    "subset_hint",
    "trailers_reply",
]

#: the picked endpoint(s): a request header and a dynamic metadata key of the same value
DESTINATION = "x-gateway-destination-endpoint"
#: the namespace of :data:`DESTINATION` in the dynamic metadata (and of :data:`SERVED`)
DESTINATION_NS = "envoy.lb"
#: the endpoints the picker may choose from (request filter metadata), when Envoy gives them
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NS = "envoy.lb.subset_hint"
#: the endpoint that served the request (response filter metadata)
SERVED = "x-gateway-destination-endpoint-served"

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
Headers = Sequence[tuple[str, str]]


def header_map(headers: HttpHeaders) -> dict[str, str]:
    """Envoy's header map as ``{lowercase name: value}`` (pseudo-headers ``:path`` etc. too).
    Envoy sends ``raw_value`` (bytes, read as Latin-1: one char per byte); ``value`` otherwise.
    A repeated header keeps its last value."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def endpoint_of(url: str) -> str:
    """``host:port`` of a worker URL (``[v6]:port`` for an IPv6 host), the default port of its
    scheme when it names none: what Envoy's ORIGINAL_DST cluster connects to."""
    u = urlsplit(url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _normal(entry: str) -> str:
    """A subset entry as :func:`endpoint_of` writes endpoints (``host:port``, ``[v6]:port``), or
    its host alone (``host``, ``[v6]``) when it names no port: any port of that host."""
    e = entry.strip().lower()
    if e.startswith("["):
        host, _, rest = e[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif e.count(":") == 1:
        host, _, port = e.partition(":")
    else:  # a host without port, or a bare IPv6 address
        host, port = e, ""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port else host


def in_subset(endpoint: str, subset: frozenset[str]) -> bool:
    """Whether ``endpoint`` (as :func:`endpoint_of` writes it) is one :func:`subset_hint` allows."""
    return endpoint in subset or endpoint.rpartition(":")[0] in subset


def subset_hint(metadata: Metadata) -> frozenset[str] | None:
    """The endpoints of ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``
    (:func:`in_subset` reads them): None when not given (any endpoint will do), else the set
    (empty: none will). Envoy's header to metadata rules write one comma string, a control plane
    a list (of strings, maybe comma strings themselves): both are read."""
    ns = metadata.filter_metadata.get(SUBSET_NS)
    if ns is None or SUBSET not in ns.fields:
        return None
    v = ns.fields[SUBSET]
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        items: Iterable[str] = [v.string_value]
    elif kind == "list_value":
        items = [x.string_value for x in v.list_value.values if x.HasField("string_value")]
    else:
        items = []
    return frozenset(_normal(e) for item in items for e in item.split(",") if e.strip())


def served_endpoint(metadata: Metadata) -> str | None:
    """``envoy.lb`` / ``x-gateway-destination-endpoint-served`` of a response, when Envoy gives
    it (with fallbacks, the endpoint that answered may not be the first picked)."""
    ns = metadata.filter_metadata.get(DESTINATION_NS)
    if ns is None or SERVED not in ns.fields:
        return None
    v = ns.fields[SERVED]
    return v.string_value if v.HasField("string_value") else None


def _mutation(set_headers: Headers, remove: Sequence[str] = ()) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(
                header=HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def picked(
    endpoints: Sequence[str], set_headers: Headers, remove: Sequence[str]
) -> ProcessingResponse:
    """The request headers' answer once a worker is picked: the pick in the header, ``endpoints``
    (the pick first, then any fallbacks, comma-separated) in the dynamic metadata, the other
    ``set_headers`` set, ``remove`` removed, and the route cache cleared so Envoy routes on the
    new header. The header carries the pick alone: Envoy's ORIGINAL_DST cluster reads one
    ``ip:port`` from it (a list there is a 503); the list is for a load balancer that reads the
    metadata (Envoy's dynamic forwarding policy)."""
    meta = Struct()
    meta.update({DESTINATION_NS: {DESTINATION: ",".join(endpoints)}})
    common = CommonResponse(
        header_mutation=_mutation([(DESTINATION, endpoints[0]), *set_headers], remove),
        clear_route_cache=True,
    )
    return ProcessingResponse(
        request_headers=HeadersResponse(response=common), dynamic_metadata=meta
    )


def headers_reply(*, request: bool, set_headers: Headers = ()) -> ProcessingResponse:
    """Continue with the headers as they are, plus ``set_headers``."""
    common = CommonResponse(header_mutation=_mutation(set_headers)) if set_headers else None
    r = HeadersResponse(response=common)
    if request:
        return ProcessingResponse(request_headers=r)
    return ProcessingResponse(response_headers=r)


def body_chunk(data: bytes, end_of_stream: bool, *, request: bool) -> ProcessingResponse:
    """``data`` passed on unchanged, as one streamed chunk of the request or response body."""
    common = CommonResponse(
        body_mutation=BodyMutation(
            streamed_response=StreamedBodyResponse(body=data, end_of_stream=end_of_stream)
        )
    )
    if request:
        return ProcessingResponse(request_body=BodyResponse(response=common))
    return ProcessingResponse(response_body=BodyResponse(response=common))


def trailers_reply(*, request: bool) -> ProcessingResponse:
    """Continue with the trailers as they are."""
    if request:
        return ProcessingResponse(request_trailers=TrailersResponse())
    return ProcessingResponse(response_trailers=TrailersResponse())


def immediate(
    status: int, message: str, type_: str, set_headers: Headers = ()
) -> ProcessingResponse:
    """Envoy answers the client itself: ``status``, the OpenAI error body, JSON."""
    headers = [("content-type", "application/json"), *set_headers]
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status),  # (proto3 enums are open: any HTTP status)
            headers=_mutation(headers),
            body=error_json(message, type_),
            details=f"kvrouter_epp_{status}",
        )
    )
