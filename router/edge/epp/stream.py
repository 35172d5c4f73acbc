"""One ext_proc stream of the endpoint picker: one HTTP request that Envoy forwards, from its
headers to the end of its answer (:class:`EppStream`).

Envoy's ext_proc filter runs with ``request_body_mode`` and ``response_body_mode``
``FULL_DUPLEX_STREAMED`` (headers and trailers ``SEND``): it sends the request headers, the body
in chunks, maybe trailers, and holds the request until the picker answers them all.

- request phase (at most ``epp.stream_timeout_s``, else 408): the body is buffered, at most
  ``proxy.max_body_bytes`` (else 413). At its end (or at once for a bodiless request) the request
  is placed: a completions or chat body is decoded as the proxy decodes it (same tokenizer, model,
  LoRA, cache salt; a bad one 400/422), any other path by load alone; the API keys, when
  configured, are checked (401) and never reach the worker; past ``proxy.max_inflight`` 429, an
  unknown model 404, no eligible worker (in Envoy's subset hint, when given) 503. Any of these is
  an ``ImmediateResponse``. Then, in order: the request headers' answer (the pick), the body
  echoed chunk by chunk, unchanged, and the trailers' answer when trailers came;
- response phase: every body chunk is passed back at once, unchanged; the flight's first byte is
  the answer's first body byte (what the proxy times: a worker sends its head before the first
  token), and the usage of the answer (SSE chunk or whole JSON) is read for its cached tokens.
  With ``response_body_mode: NONE`` (Envoy says so in its first message's ``protocol_config``)
  no chunk comes: the answer's head stands for its first byte (a worker that sends its head
  with the first token, as the bundled engine does, makes that exact), no usage is read, and
  the stream's end — Envoy closes or resets it when the answer is done, as long as its
  ``response_trailer_mode`` is ``SEND`` (``kvrouter.gateway.answer_head_only``) — ends the flight
  with the head's status (a client leaving mid-answer looks the same). The light way to run the
  picker: no answer byte crosses gRPC.

The placement is a :class:`router.placement.Flight` of kind ``epp``: it counts in
``proxy.max_inflight`` and the proxy's in-flight, TTFB and proxied metrics. It ends exactly once:
with the answer's end (its status), or when the stream ends first — Envoy reset it, went away,
the server stopped (``client_disconnect``) — or broke the protocol (``protocol_error``). One
access-log line per stream, as the HTTP server writes one per request.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from router.edge.access import request_id, write_access
from router.edge.epp.errors import ProtocolError, Unsupported
from router.edge.epp.messages import (
    Reply,
    body_chunk,
    endpoint_of,
    header_map,
    headers_reply,
    immediate,
    in_subset,
    picked,
    served_endpoint,
    subset_hint,
    trailers_reply,
)
from router.edge.proxy import request_tokens
from router.errors import (
    NoHealthyWorker,
    PayloadTooLarge,
    RequestTimeout,
    RouterError,
    TooManyRequests,
    require_bearer,
)
from router.placement import Flight, cached_tokens_of
from router.runtime import Runtime

__all__ = ["EppStream", "Read", "Write"]

#: the next message of the stream; None once Envoy closed its side
Read = Callable[[], Awaitable[ProcessingRequest | None]]
#: send one answer (serialized: :mod:`router.edge.epp.messages` builds them so)
Write = Callable[[Reply], Awaitable[None]]
#: a request read whole: headers, subset hint, body chunks, body size (None: bodiless),
#: trailers came, its x-request-id is new
_Request = tuple[dict[str, str], frozenset[str] | None, list[bytes], int | None, bool, bool]

_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
#: a whole (not SSE) answer is kept up to this size to read its usage; past it, not read
_WHOLE_MAX = 1 << 20
#: the only headers the picker reads (of the request, of the answer)
_REQUEST_HEADERS = frozenset({":method", ":path", "x-request-id", "authorization"})
_RESPONSE_HEADERS = frozenset({":status", "content-type"})
_STREAMED = ProcessingMode.FULL_DUPLEX_STREAMED
_NO_BODY = ProcessingMode.NONE


class EppStream:
    """One stream; :meth:`run` serves it to its end. ``refuse``: answer 429 whatever it asks
    (the server is past ``epp.max_streams``)."""

    def __init__(self, state: Runtime, read: Read, write: Write, *, refuse: bool = False) -> None:
        self.state = state
        self.read = read
        self.write = write
        self.refuse = refuse
        self.t0 = time.perf_counter()
        self.method = ""
        self.path = ""
        self.rid = b""
        self.status = 0  # the answer's HTTP status, once known
        self.worker = ""
        self.nbytes = 0  # answer body bytes
        self.ttfb: float | None = None
        self.flight: Flight | None = None
        self.answer_headers: list[tuple[str, str]] = []
        self.by_endpoint: dict[str, str] = {}  # picked endpoint -> worker id
        self.sse = False
        self.whole: bytearray | None = None
        self.ending = "client_disconnect"  # how the flight ends if the stream ends first
        #: Envoy sends the answer's head, not its body (response_body_mode NONE)
        self.head_only = False

    async def run(self) -> None:
        try:
            if await self._request():
                await self._response()
        except ProtocolError:
            self.ending = "protocol_error"
            raise
        finally:
            self._end(self.ending)
            if self.rid:  # (a request was read: its line, as the HTTP server writes one)
                path = self.path.partition("?")[0]
                nbytes, ttfb, t0, rid = self.nbytes, self.ttfb, self.t0, self.rid
                write_access(self.method, path, self.status, self.worker, nbytes, ttfb, t0, rid)

    # ------------------------------------------------------------------ request phase

    async def _request(self) -> bool:
        """Read the request and answer it; True once a worker is picked."""
        try:
            got = await self._read_in_time()
            return got is not None and await self._pick(*got)
        except RouterError as e:
            await self._refuse(e)
            return False

    async def _read_in_time(self) -> _Request | None:
        """:meth:`_read_request` within ``epp.stream_timeout_s`` (else :class:`RequestTimeout`):
        one timer for the whole request, not one per message (``asyncio.wait_for`` would add a
        task and a timer to every read)."""
        timeout = self.state.settings.epp.stream_timeout_s
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            return await self._read_request()
        except asyncio.CancelledError:
            if not expired:
                raise
            if sys.version_info >= (3, 11):
                task.uncancel()  # (the cancel was the timer's, and is handled here)
            raise RequestTimeout(f"request not received within {timeout:g} s") from None
        finally:
            timer.cancel()

    async def _read_request(self) -> _Request | None:
        """The request's headers, body chunks and trailers; None if Envoy went away first."""
        first = await self.read()
        if first is None:
            return None  # gone before a word
        if first.WhichOneof("request") != "request_headers":
            raise ProtocolError(f"{_phase(first)} before request_headers")
        if first.HasField("protocol_config"):
            self.head_only = _check_modes(first)
        headers = header_map(first.request_headers, _REQUEST_HEADERS)
        self.method, self.path = headers.get(":method", ""), headers.get(":path", "")
        given = headers.get("x-request-id")
        given_id = given.encode("latin-1", "replace") if given is not None else None
        self.rid, new_id = request_id(given_id)
        self.answer_headers.append(("x-request-id", self.rid.decode("ascii")))
        if self.refuse:
            n = self.state.settings.epp.max_streams
            raise TooManyRequests(f"over epp.max_streams ({n} streams open)")
        subset = subset_hint(first.metadata_context)
        chunks: list[bytes] = []
        size, trailers = 0, False
        limit = self.state.settings.proxy.max_body_bytes
        done = bodiless = first.request_headers.end_of_stream
        while not done:
            m = await self.read()
            if m is None:
                return None  # Envoy went away mid-body: no flight yet
            kind = m.WhichOneof("request")
            if kind == "request_body":
                data = m.request_body.body
                if data:
                    size += len(data)
                    if size > limit:
                        raise PayloadTooLarge(f"request body over {limit} bytes")
                    chunks.append(data)
                done = m.request_body.end_of_stream
            elif kind == "request_trailers":
                trailers = done = True  # (a body that ends with trailers has no end_of_stream)
            else:
                raise ProtocolError(f"{_phase(m)} before the end of the request")
        return headers, subset, chunks, None if bodiless else size, trailers, new_id

    async def _pick(
        self,
        headers: dict[str, str],
        subset: frozenset[str] | None,
        chunks: list[bytes],
        size: int | None,
        trailers: bool,
        new_id: bool,
    ) -> bool:
        """Place the request read (``size``: of its body, None when bodiless) and answer it:
        the pick, the body echoed, the trailers' answer."""
        set_headers = [("x-request-id", self.rid.decode("ascii"))] if new_id else []
        if size is not None:  # (the length Envoy's streamed body mode may have dropped)
            set_headers.append(("content-length", str(size)))
        endpoints, more, remove = await self._place(headers, b"".join(chunks), subset)
        await self.write(picked(endpoints, [*set_headers, *more], remove))
        last = len(chunks) - 1
        for i, c in enumerate(chunks):
            await self.write(body_chunk(c, not trailers and i == last, request=True))
        if size is not None and not chunks and not trailers:
            await self.write(body_chunk(b"", True, request=True))
        if trailers:
            await self.write(trailers_reply(request=True))
        return True

    async def _place(
        self, headers: dict[str, str], body: bytes, subset: frozenset[str] | None
    ) -> tuple[list[str], list[tuple[str, str]], list[str]]:
        """Pick and commit a worker: (its endpoint then any fallbacks, headers to set, headers to
        remove). Raises :class:`RouterError` for the client's answer."""
        state = self.state
        s = state.settings
        remove = ["x-data-parallel-rank"]  # only the picker says which rank serves it
        if s.api_keys:  # the router's own client keys: checked here, never passed to a worker
            require_bearer(headers.get("authorization"), s.api_keys, "the OpenAI endpoints")
            remove.append("authorization")
        if state.inflight >= s.proxy.max_inflight:
            raise TooManyRequests(f"over max_inflight ({s.proxy.max_inflight} requests in flight)")
        placer = state.placer
        endpoint = _ENDPOINTS.get(self.path.partition("?")[0])
        if endpoint is not None:
            req, tokens, _ = await request_tokens(state, endpoint, body)
            d = placer.place(tokens, req.model, req.lora_name, req.cache_salt)
        else:  # (a GET /v1/models, an embedding...): no prompt to match, the load decides
            d = placer.place((), None)
        # the pick, then up to epp.fallbacks other endpoints, best first (only the pick is
        # committed); endpoints are read only as far as needed (a fleet may be large)
        endpoints: list[str] = []
        i = -1
        for j in d.order:
            e = endpoint_of(d.states[j].url)
            if (subset is not None and not in_subset(e, subset)) or e in self.by_endpoint:
                continue
            if not endpoints:
                i = j
            endpoints.append(e)
            self.by_endpoint[e] = d.states[j].id
            if len(endpoints) > s.epp.fallbacks:
                break
        if not endpoints:
            where = " in the endpoint subset" if subset is not None else ""
            raise NoHealthyWorker(f"no healthy worker{where} for this request")
        ws, cand = d.states[i], d.candidates[i]
        more: list[tuple[str, str]] = []
        self.worker = ws.id
        self.answer_headers += [
            ("x-kvrouter-worker", ws.id),
            ("x-kvrouter-matched-blocks", str(cand.matched_blocks)),
        ]
        if ws.config.dp_ranks > 1:
            more.append(("x-data-parallel-rank", str(cand.key[1])))
            remove.remove("x-data-parallel-rank")
            self.answer_headers.append(("x-kvrouter-dp-rank", str(cand.key[1])))
        self.flight = placer.fly(
            d, i, "epp", endpoint=endpoint or "other", t0=self.t0, by_events=self.head_only
        )
        state.inflight += 1
        return endpoints, more, remove

    async def _refuse(self, e: RouterError) -> None:
        self.status = e.status
        self.state.metrics.rejected.labels(str(e.status)).inc()
        await self.write(immediate(e.status, e.message, e.type, self.answer_headers))

    # ------------------------------------------------------------------ response phase

    async def _response(self) -> None:
        """Pass the answer through, chunk by chunk, until its end or the stream's."""
        flight = self.flight
        assert flight is not None
        while True:
            m = await self.read()
            if m is None:
                return  # the stream ended: run ends the flight (head only: with the head's status)
            kind = m.WhichOneof("request")
            if kind == "response_headers":
                if self.status:
                    raise ProtocolError("response_headers twice")
                self._served(m)
                h = header_map(m.response_headers, _RESPONSE_HEADERS)
                try:
                    self.status = int(h.get(":status", ""))
                except ValueError as e:
                    raise ProtocolError(f"response :status {h.get(':status')!r}") from e
                self.sse = "text/event-stream" in h.get("content-type", "")
                if not self.head_only:
                    if self.status == 200 and not self.sse:
                        self.whole = bytearray()
                elif not m.response_headers.end_of_stream:
                    # no body will come: the head is timed as the first byte, and the stream's
                    # end, a close or a reset (Envoy does either, maybe before our answer to
                    # the head is written), stands for the answer's: set before that answer
                    # goes. (A client leaving mid-answer looks the same to the picker.) The
                    # prefill ends with the worker's events: vLLM sends the head
                    # before it has begun (Flight.head)
                    self.ttfb = time.perf_counter() - self.t0
                    flight.head()
                    self.ending = str(self.status)
                await self.write(headers_reply(request=False, set_headers=self.answer_headers))
                if m.response_headers.end_of_stream:
                    return self._complete()
            elif kind == "response_body" and self.status:
                data = m.response_body.body
                if data:
                    self._seen(flight, data)
                end = m.response_body.end_of_stream
                await self.write(body_chunk(data, end, request=False))
                if end:
                    return self._complete()
            elif kind == "response_trailers" and self.status:
                await self.write(trailers_reply(request=False))
                return self._complete()
            else:
                where = "after the answer's head" if self.status else "before the answer's head"
                raise ProtocolError(f"{_phase(m)} {where}")

    def _served(self, m: ProcessingRequest) -> None:
        """The worker that answered, for the access log (a fallback may have; the flight stays
        on the worker picked first)."""
        served = served_endpoint(m.metadata_context)
        if served is not None and served in self.by_endpoint:
            self.worker = self.by_endpoint[served]

    def _seen(self, flight: Flight, data: bytes) -> None:
        if self.ttfb is None:
            self.ttfb = time.perf_counter() - self.t0
            flight.first_byte()
        self.nbytes += len(data)
        if self.sse:
            flight.scan(data)
        elif self.whole is not None:
            if len(self.whole) + len(data) > _WHOLE_MAX:
                self.whole = None
            else:
                self.whole += data

    def _complete(self) -> None:
        flight = self.flight
        assert flight is not None
        flight.first_byte()  # (an answer without a body: its end is its first byte)
        if self.whole:
            flight.cached = cached_tokens_of(bytes(self.whole))
        self.ending = str(self.status)
        self._end(self.ending)

    def _end(self, status: str) -> None:
        """End the flight (once: it keeps the in-flight count with it)."""
        flight, self.flight = self.flight, None
        if flight is not None:
            self.state.inflight -= 1
            flight.done(status)


def _phase(m: ProcessingRequest) -> str:
    return m.WhichOneof("request") or "a message of no phase"


def _check_modes(first: ProcessingRequest) -> bool:
    """The body modes Envoy says it runs with (newer Envoys send them on the first message):
    the picker holds the request headers' answer until the body's end, which only the full
    duplex mode allows; the answer's body may also not be sent at all (True: then the picker
    sees the answer's head and its end, and reads no usage)."""
    pc = first.protocol_config
    if pc.request_body_mode != _STREAMED:
        name = ProcessingMode.BodySendMode.Name(pc.request_body_mode)
        raise Unsupported(f"request_body_mode {name}: the picker needs FULL_DUPLEX_STREAMED")
    if pc.response_body_mode not in (_STREAMED, _NO_BODY):
        name = ProcessingMode.BodySendMode.Name(pc.response_body_mode)
        raise Unsupported(f"response_body_mode {name}: the picker needs FULL_DUPLEX_STREAMED")
    return pc.response_body_mode == _NO_BODY
