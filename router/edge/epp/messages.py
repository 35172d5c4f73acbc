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

Every answer is built here already serialized (:data:`Reply`, bytes the server writes as they
are): the picker answers 5-6 messages per request, and gRPC's own cost per message is what the
picker cannot cut, so its own is kept small — the constant answers (a bare CONTINUE, the
trailers') are serialized once, the dynamic metadata once per endpoint list (a serialized
message followed by another parses as their merge), a body chunk through the field path of one
message rather than five nested constructors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from urllib.parse import urlsplit

from envoy.config.core.v3.base_pb2 import HeaderValueOption, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from google.protobuf.struct_pb2 import Struct

from router.edge.epp.errors import Unsupported
from router.errors import error_json

_FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_NO_BODY = ProcessingMode.NONE

__all__ = [
    "DESTINATION",
    "DESTINATION_NS",
    "SERVED",
    "SUBSET",
    "SUBSET_NS",
    "Reply",
    "body_chunk",
    "check_modes",
    "endpoint_of",
    "header_map",
    "headers_reply",
    "immediate",
    "in_subset",
    "phase",
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
#: a serialized ProcessingResponse
Reply = bytes


def header_map(headers: HttpHeaders, names: frozenset[str] | None = None) -> dict[str, str]:
    """Envoy's header map as ``{lowercase name: value}`` (pseudo-headers ``:path`` etc. too),
    only the ``names`` given when given (the rest not decoded). Envoy sends ``raw_value``
    (bytes, read as Latin-1: one char per byte); ``value`` otherwise. A repeated header keeps
    its last value."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        k = h.key.lower()
        if names is None or k in names:
            raw = h.raw_value
            out[k] = raw.decode("latin-1") if raw else h.value
    return out


@lru_cache(maxsize=4096)  # (a pure function of a worker's URL, asked per worker per request)
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


def _mutate(m: HeaderMutation, set_headers: Headers, remove: Sequence[str] = ()) -> None:
    """Fill ``m`` (a message's own field, built in place): set ``set_headers``, remove
    ``remove``."""
    for k, v in set_headers:
        o = m.set_headers.add(append_action=_OVERWRITE)
        o.header.key = k
        o.header.raw_value = v.encode()
    if remove:
        m.remove_headers.extend(remove)


@lru_cache(maxsize=1024)  # (a pure function of the endpoint list: a few per fleet)
def _metadata(endpoints: str) -> Reply:
    """``dynamic_metadata`` alone, serialized: appended to the pick's headers answer."""
    meta = Struct()
    meta.update({DESTINATION_NS: {DESTINATION: endpoints}})
    return ProcessingResponse(dynamic_metadata=meta).SerializeToString()


def picked(endpoints: Sequence[str], set_headers: Headers, remove: Sequence[str]) -> Reply:
    """The request headers' answer once a worker is picked: the pick in the header, ``endpoints``
    (the pick first, then any fallbacks, comma-separated) in the dynamic metadata, the other
    ``set_headers`` set, ``remove`` removed, and the route cache cleared so Envoy routes on the
    new header. The header carries the pick alone: Envoy's ORIGINAL_DST cluster reads one
    ``ip:port`` from it (a list there is a 503); the list is for a load balancer that reads the
    metadata (Envoy's dynamic forwarding policy)."""
    r = ProcessingResponse()
    common = r.request_headers.response
    _mutate(common.header_mutation, [(DESTINATION, endpoints[0]), *set_headers], remove)
    common.clear_route_cache = True
    return r.SerializeToString() + _metadata(",".join(endpoints))


_CONTINUE = {
    True: ProcessingResponse(request_headers=HeadersResponse()).SerializeToString(),
    False: ProcessingResponse(response_headers=HeadersResponse()).SerializeToString(),
}
_TRAILERS = {
    True: ProcessingResponse(request_trailers=TrailersResponse()).SerializeToString(),
    False: ProcessingResponse(response_trailers=TrailersResponse()).SerializeToString(),
}


def headers_reply(*, request: bool, set_headers: Headers = ()) -> Reply:
    """Continue with the headers as they are, plus ``set_headers``."""
    if not set_headers:
        return _CONTINUE[request]
    r = ProcessingResponse()
    common = (r.request_headers if request else r.response_headers).response
    _mutate(common.header_mutation, set_headers)
    return r.SerializeToString()


def body_chunk(data: bytes, end_of_stream: bool, *, request: bool) -> Reply:
    """``data`` passed on unchanged, as one streamed chunk of the request or response body."""
    r = ProcessingResponse()
    body = (r.request_body if request else r.response_body).response.body_mutation
    chunk = body.streamed_response
    chunk.SetInParent()  # (present even when empty: an empty last chunk is still an answer)
    chunk.body = data
    chunk.end_of_stream = end_of_stream
    return r.SerializeToString()


def trailers_reply(*, request: bool) -> Reply:
    """Continue with the trailers as they are."""
    return _TRAILERS[request]


def immediate(
    status: int, message: str, type_: str, set_headers: Headers = (), param: str | None = None
) -> Reply:
    """Envoy answers the client itself: ``status``, the OpenAI error body, JSON."""
    r = ProcessingResponse()
    im = r.immediate_response
    im.status.code = status  # (proto3 enums are open: any HTTP status)
    _mutate(im.headers, [("content-type", "application/json"), *set_headers])
    im.body = error_json(message, type_, param)
    im.details = f"kvrouter_epp_{status}"
    return r.SerializeToString()


def phase(m: ProcessingRequest) -> str:
    return m.WhichOneof("request") or "a message of no phase"


def check_modes(first: ProcessingRequest) -> bool:
    """The body modes Envoy says it runs with (newer Envoys send them on the first message):
    the picker holds the request headers' answer until the body's end, which only the full
    duplex mode allows; the answer's body may also not be sent at all (True: then the picker
    sees the answer's head and its end, and reads no usage)."""
    pc = first.protocol_config
    if pc.request_body_mode != _FULL_DUPLEX:
        name = ProcessingMode.BodySendMode.Name(pc.request_body_mode)
        raise Unsupported(f"request_body_mode {name}: the picker needs FULL_DUPLEX_STREAMED")
    if pc.response_body_mode not in (_FULL_DUPLEX, _NO_BODY):
        name = ProcessingMode.BodySendMode.Name(pc.response_body_mode)
        raise Unsupported(f"response_body_mode {name}: the picker needs FULL_DUPLEX_STREAMED")
    return pc.response_body_mode == _NO_BODY
