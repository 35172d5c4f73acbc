"""The endpoint picker's gRPC server (:class:`EppServer`): Envoy's
``envoy.service.ext_proc.v3.ExternalProcessor/Process`` (one :class:`router.edge.epp.stream.
EppStream` per stream) and the standard ``grpc.health.v1.Health`` service, on ``grpc.aio`` in the
router's own event loop (the app's lifespan starts and stops it, next to uvicorn).

- health, per the endpoint picker protocol: ``liveness`` SERVING while the server is up;
  ``readiness`` follows the router's ``/ready`` (:meth:`router.runtime.Runtime.ready`: a live
  worker, not draining), re-read every half second; ``envoy.service.ext_proc.v3.ExternalProcessor``
  and ``""`` (the whole server) follow readiness. All turn NOT_SERVING when the server stops;
- ``epp.max_streams`` bounds the streams served at once (each may buffer a body of up to
  ``proxy.max_body_bytes``), per connection in gRPC and in all in the picker; what the others
  get, and the gRPC core limits set so none is lost unseen: :mod:`router.edge.epp.limits`;
- a stream that breaks the protocol, or a message that is not a ``ProcessingRequest``, is closed
  with a gRPC status (INVALID_ARGUMENT, FAILED_PRECONDITION) and one warning line; the request
  deserializer is the picker's own so a malformed message never reaches gRPC's error log;
- TLS by default (a self-signed certificate when no file is given), plaintext only by
  ``epp.plaintext``: :mod:`router.edge.epp.tls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.edge.epp.errors import EppError, ProtocolError
from router.edge.epp.limits import OVERLOAD, StreamGate, server_options
from router.edge.epp.stream import EppStream
from router.edge.epp.tls import server_credentials
from router.errors import ConfigError
from router.runtime import Runtime

__all__ = ["EXT_PROC_SERVICE", "EppServer"]

log = logging.getLogger("kvrouter.epp")

EXT_PROC_SERVICE = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
LIVENESS = "liveness"
READINESS = "readiness"
#: the health names that follow the router's readiness
_READY_NAMES = (READINESS, EXT_PROC_SERVICE, "")
_READY_EVERY_S = 0.5
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: room for gRPC framing and the message's other fields around a body chunk
_MESSAGE_SLACK = 1 << 16


class _Malformed:
    """What the picker's deserializer hands over for bytes that are not a ProcessingRequest."""

    def __init__(self, error: str) -> None:
        self.error = error


def _parse(data: bytes) -> ext_proc.ProcessingRequest | _Malformed:
    try:
        return ext_proc.ProcessingRequest.FromString(data)
    except DecodeError as e:
        return _Malformed(str(e))


class EppServer:
    """The picker's gRPC server for one router app (its :class:`Runtime`); ``port`` once
    :meth:`start` has bound it (``epp.port: 0``: the port the system chose)."""

    def __init__(self, state: Runtime) -> None:
        self.state = state
        self.settings = state.settings.epp
        self.port = 0
        self.gate = StreamGate(self.settings.max_streams, state.metrics.epp)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        self._ready = False

    async def start(self) -> int:
        s = self.settings
        max_message = max(4 << 20, self.state.settings.proxy.max_body_bytes + _MESSAGE_SLACK)
        server = grpc.aio.server(options=server_options(s.max_streams, max_message))
        process = grpc.stream_stream_rpc_method_handler(
            self._process,
            request_deserializer=_parse,
            # the answers come serialized (router.edge.epp.messages): written as they are
            response_serializer=bytes,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": process}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        host = f"[{s.host}]" if ":" in s.host else s.host
        address = f"{host}:{s.port}"
        creds, scheme = server_credentials(s)
        try:
            if creds is not None:
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except (RuntimeError, OSError) as e:
            raise ConfigError(f"epp: cannot listen on {address}: {e}") from e
        await self.health.set(LIVENESS, _SERVING)
        await self._set_ready(self.state.ready()[0])
        await server.start()
        self._server = server
        self._watch = asyncio.create_task(self._follow_readiness(), name="epp-readiness")
        log.info("EPP listening on %s:%d (%s)", host, self.port, scheme)
        return self.port

    @property
    def streams(self) -> int:
        """ext_proc streams open now (served or being refused)."""
        return self.gate.open

    async def stop(self) -> None:
        """NOT_SERVING on every health name, then streams get ``epp.shutdown_grace_s`` to end;
        the rest are cancelled (their flights end as ``client_disconnect``)."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.settings.shutdown_grace_s)
            self._server = None

    async def _set_ready(self, ready: bool) -> None:
        self._ready = ready  # (what the health service answers)
        for name in _READY_NAMES:
            await self.health.set(name, _SERVING if ready else _NOT_SERVING)

    async def _follow_readiness(self) -> None:
        while True:
            await asyncio.sleep(_READY_EVERY_S)
            now = self.state.ready()[0]
            if now != self._ready:
                await self._set_ready(now)

    async def _process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """One ext_proc stream, read and written through ``context`` (never the iterator)."""

        async def read() -> ext_proc.ProcessingRequest | None:
            m = await context.read()
            if m is grpc.aio.EOF:
                return None
            if isinstance(m, _Malformed):
                raise ProtocolError(f"not a ProcessingRequest: {m.error}")
            return m

        refused = self.gate.enter()
        try:
            if refused == OVERLOAD:  # (before a read: a stream that never speaks holds nothing)
                context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                context.set_details(f"endpoint picker overloaded ({self.gate.open} streams open)")
                return
            stream = EppStream(self.state, read, context.write, refuse=refused is not None)
            await stream.run()
        except EppError as e:
            log.warning("EPP stream closed (%s): %s", e.code, e)
            context.set_code(getattr(grpc.StatusCode, e.code))
            context.set_details(str(e))
        except Exception:  # a bug: one line with its traceback, and the stream closed
            log.exception("EPP stream failed")
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details("internal error of the endpoint picker")
        finally:
            self.gate.leave()
