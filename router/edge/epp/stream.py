"""One ext_proc stream of the endpoint picker: one HTTP request that Envoy forwards, from its
headers to the end of its answer (:class:`EppStream`). Envoy runs ext_proc with both body modes
``FULL_DUPLEX_STREAMED`` (headers and trailers ``SEND``) and holds the request until the picker
has answered all of it.

- request phase (at most ``epp.stream_timeout_s``, else 408): the body is buffered, at most
  ``proxy.max_body_bytes`` (else 413), then the request goes through the front door
  (:mod:`router.edge.door`, as the proxy's: keys 401, ``proxy.max_inflight`` 429, a bad body
  400/422, an unknown model 404, no eligible worker in Envoy's subset hint 503, each an
  ``ImmediateResponse``; a path with no prompt is placed by load). Then: the pick (the decode
  worker; for a remote pick ``x-prefiller-host-port`` names the prefill worker, for llm-d's
  routing sidecar), the body echoed unchanged, the trailers' answer when trailers came;
- response phase: every body chunk passes back at once, unchanged; the first body byte is the
  flight's first byte, and the answer's usage is read for its cached tokens. With
  ``response_body_mode: NONE`` only the head comes: it stands for the first byte, no usage is
  read, and the stream's end (Envoy closes or resets it after the answer, with
  ``response_trailer_mode: SEND``: ``kvrouter.gateway.answer_head_only``) ends the flight with
  the head's status: no answer byte crosses gRPC.

The placement is a :class:`router.placement.Flight` of kind ``epp`` (a remote pick: one per
leg), counted like the proxy's. It ends exactly once: with the answer's end (its status), or
with the stream — Envoy reset it or went away, the server stopped (``client_disconnect``) — or a
protocol break (``protocol_error``). One access-log line per stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from router.edge.access import request_id, why_of, write_access
from router.edge.door import enter, pick_headers
from router.edge.epp.deadline import Deadline
from router.edge.epp.errors import ProtocolError
from router.edge.epp.messages import (
    Reply,
    body_chunk,
    check_modes,
    endpoint_of,
    header_map,
    headers_reply,
    immediate,
    in_subset,
    phase,
    picked,
    served_endpoint,
    subset_hint,
    trailers_reply,
)
from router.edge.usage import UsageScan, cached_tokens_of
from router.errors import (
    PayloadTooLarge,
    RequestTimeout,
    RouterError,
    TooManyRequests,
)
from router.placement import Admission, Flight, WorkerView, cached_tokens
from router.runtime import Runtime

__all__ = ["EppStream", "Read", "Write"]

log = logging.getLogger("kvrouter.epp")

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
#: llm-d's routing sidecar on a decode worker prefills there first (its pd-sidecar protocol)
PREFILLER_HEADER = "x-prefiller-host-port"


class EppStream:
    """One stream; :meth:`run` serves it to its end. ``refuse``: answer 429 whatever it asks
    (the server is past ``epp.max_streams``)."""

    def __init__(self, state: Runtime, read: Read, write: Write, *, refuse: bool = False) -> None:
        self.state, self.read, self.write = state, read, write
        self.refuse = refuse
        self.t0 = time.perf_counter()
        self.method, self.path, self.rid = "", "", b""
        self.status = 0  # the answer's HTTP status, once known
        self.worker = ""
        self.nbytes = 0  # answer body bytes
        self.ttfb: float | None = None
        self.flight: Flight | None = None
        #: a remote pick's prefill leg (the decode worker's sidecar sends it)
        self.prefill_flight: Flight | None = None
        self.admission: Admission | None = None
        self.usage = UsageScan()
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
                path, why = self.path.partition("?")[0], why_of(self.answer_headers)
                nbytes, ttfb, t0, m = self.nbytes, self.ttfb, self.t0, self.method
                write_access(m, path, self.status, self.worker, nbytes, ttfb, t0, self.rid, why)

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
        one timer for the whole request."""
        deadline = Deadline(self.state.settings.epp.stream_timeout_s)
        try:
            return await self._read_request()
        except asyncio.CancelledError:
            if not deadline.fired():
                raise
            raise RequestTimeout(f"request not received within {deadline.timeout:g} s") from None
        finally:
            deadline.cancel()

    async def _read_request(self) -> _Request | None:
        """The request's headers, body chunks and trailers; None if Envoy went away first."""
        first = await self.read()
        if first is None:
            return None  # gone before a word
        if first.WhichOneof("request") != "request_headers":
            raise ProtocolError(f"{phase(first)} before request_headers")
        if first.HasField("protocol_config"):
            self.head_only = check_modes(first)
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
                raise ProtocolError(f"{phase(m)} before the end of the request")
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
        """Pick and commit a worker through the front door: (its endpoint then any fallbacks,
        headers to set, headers to remove). Raises :class:`RouterError` for the client's
        answer. A remote pick goes to the decode worker with ``x-prefiller-host-port`` naming
        the prefill worker, as llm-d's routing sidecar on the decode worker expects."""
        state = self.state
        s = state.settings
        # only the picker says which rank serves it and which worker prefills it
        remove = ["x-data-parallel-rank", PREFILLER_HEADER]
        if s.api_keys:  # the router's own client keys: never passed to a worker
            remove.append("authorization")

        def eligible(ws: WorkerView) -> bool:  # (Envoy's subset hint, when it gives one)
            return subset is None or in_subset(endpoint_of(ws.url), subset)

        endpoint = _ENDPOINTS.get(self.path.partition("?")[0])
        auth = headers.get("authorization")
        entry = await enter(state, endpoint, body, auth, eligible=eligible)
        self.admission = entry.admission
        pick = entry.pick
        d = pick.decision
        # the pick, then up to epp.fallbacks other endpoints, best first (only the pick is
        # committed); endpoints are read only as far as needed (a fleet may be large)
        endpoints: list[str] = []
        for c in pick.decodes:
            ep = endpoint_of(c.worker.url)
            if ep in self.by_endpoint:
                continue
            endpoints.append(ep)
            self.by_endpoint[ep] = c.worker.id
            if len(endpoints) > s.epp.fallbacks:
                break
        dc = pick.decode
        ws, cand = dc.worker, dc.cand
        more: list[tuple[str, str]] = []
        self.worker = ws.id
        self.answer_headers += pick_headers(pick, explain=s.scoring.explain)
        if ws.config.dp_ranks > 1:
            more.append(("x-data-parallel-rank", str(cand.key[1])))
            remove.remove("x-data-parallel-rank")
        kind, where = "epp", endpoint or "other"
        p = pick.prefill
        if p is not None:
            more.append((PREFILLER_HEADER, endpoint_of(p.worker.url)))
            remove.remove(PREFILLER_HEADER)
            self.prefill_flight = state.placer.fly(
                d, p.index, kind, endpoint=where, t0=self.t0, by_events=True, leg="prefill"
            )
        leg = "decode" if p is not None else ""
        f = state.placer.fly(
            d, dc.index, kind, endpoint=where, t0=self.t0, by_events=self.head_only, leg=leg
        )
        self.flight = f
        if p is not None:  # (the decode worker reports the prefill worker's hit: vLLM >= 0.32)
            f.predicted_tokens = cached_tokens(p.cand, d.tokens, d.block_size)
        return endpoints, more, remove

    async def _refuse(self, e: RouterError) -> None:
        self.status = e.status
        self.state.metrics.rejected.labels(str(e.status)).inc()
        await self.write(immediate(e.status, e.message, e.type, self.answer_headers, e.param))

    # ------------------------------------------------------------------ response phase

    async def _response(self) -> None:
        """:meth:`_answer`, each of its messages within ``epp.response_timeout_s`` of the one
        before (from the pick: the answer's head): a stalled or partitioned Envoy that goes
        silent ends the stream and its flight (``timeout``), never holds them for good."""
        deadline = Deadline(self.state.settings.epp.response_timeout_s)
        try:
            await self._answer(deadline)
        except asyncio.CancelledError:
            if not deadline.fired():
                raise
            log.warning("EPP stream silent for %g s after the pick: ended", deadline.timeout)
            self.ending = "timeout"
        finally:
            deadline.cancel()

    async def _answer(self, deadline: Deadline) -> None:
        """Pass the answer through, chunk by chunk, until its end or the stream's."""
        flight = self.flight
        assert flight is not None
        while True:
            m = await self.read()
            deadline.push()
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
                    self._prefilled()
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
                raise ProtocolError(f"{phase(m)} {where}")

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
            self._prefilled()
        self.nbytes += len(data)
        if self.sse:
            self.usage.feed(data)
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
        elif self.usage.cached is not None:
            flight.cached = self.usage.cached
        self.ending = str(self.status)
        self._end(self.ending)

    def _prefilled(self) -> None:
        """The decode worker answered: a remote prefill is over (its worker's events may end
        its flight sooner; in head-only mode the head comes before it, so only they do)."""
        pf = self.prefill_flight
        if pf is not None and not self.head_only:
            self.prefill_flight = None
            pf.first_byte()
            pf.done("prefilled")

    def _end(self, status: str) -> None:
        """End the flights and the admission (once: ``done`` and ``release`` are idempotent)."""
        for f in (self.flight, self.prefill_flight):
            if f is not None:
                f.done(status)
        self.flight = self.prefill_flight = None
        if self.admission is not None:
            self.admission.release()
