"""The floor of a Python endpoint picker: an ext_proc server on uvloop (grpc.aio, as the router's
EPP; or ``--transport h2``, below) that answers Envoy's message sequence with the least work, for
``bench_epp.py --floor``. What it costs is the transport's (and the event loop's) own price per
stream and per message; the router's EPP minus the grpc.aio floor is what kvrouter adds.

    python benchmarks/epp_floor.py --endpoint 127.0.0.1:8000   # prints "EPP listening on ..."
    python benchmarks/epp_floor.py --endpoint 127.0.0.1:8000 --transport h2   # needs h2

It speaks the same protocol as ``router.edge.epp`` with Envoy's FULL_DUPLEX_STREAMED bodies both
ways: the request headers, body and trailers read to the end, then one answer naming the fixed
``--endpoint`` (header and dynamic metadata, route cache cleared), the body echoed chunk by
chunk, the trailers' answer; in the response phase every message answered at once (headers
CONTINUE, body chunks echoed) until the answer's end. No placement, no metrics, no access log,
no deadline; the constant answers are serialized once and sent as bytes. It also serves the
standard ``grpc.health.v1`` service (Envoy health-checks its EPP cluster).

``--transport h2`` serves the same picker with no gRPC library: gRPC's framing (a 5-byte prefix
per message, ``grpc-status`` trailers) on the ``h2`` package's HTTP/2 state machine, in an asyncio
protocol on the loop, a task per stream as grpc.aio runs its handlers. grpc.aio's C core reads
the sockets on a poller thread of its own and hands each message to the loop across threads;
this does not. The difference between the two floors is grpc.aio's price; what both pay is the
protocol's: Envoy's round trips to a picker, one message at a time. It is a measurement, not a
server: it trusts its one peer (no limits, no compression, deadlines or flow-control stalls).

:func:`add_floor` adds a listener ``floor`` to a rendered Envoy config (:func:`kvrouter.gateway.
render`): the ``inference`` listener's copy whose ext_proc filter asks this server instead.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

FLOOR = "floor"  # the listener's and the EPP cluster's name
FLOOR_CLUSTER = "floor_epp"


def add_floor(config: dict[str, Any], epp: tuple[str, int]) -> None:
    """A listener ``floor`` on any free port: the ``inference`` listener with its ext_proc
    filter pointed at a cluster of ``epp`` (the ``kvrouter_epp`` cluster's settings)."""
    from kvrouter.gateway import (
        EPP_CLUSTER,
        EXT_PROC,
        cluster,
        connection_manager,
        http_filter,
        listener,
    )

    second = copy.deepcopy(listener(config))
    second["name"] = FLOOR
    second["address"]["socket_address"]["port_value"] = 0
    config["static_resources"]["listeners"].append(second)
    connection_manager(config, FLOOR)["stat_prefix"] = FLOOR  # (its ext_proc stats apart)
    http_filter(config, EXT_PROC, on=FLOOR)["grpc_service"]["envoy_grpc"]["cluster_name"] = (
        FLOOR_CLUSTER
    )
    target = copy.deepcopy(cluster(config, EPP_CLUSTER))
    target["name"] = target["load_assignment"]["cluster_name"] = FLOOR_CLUSTER
    # the floor speaks plaintext gRPC; the EPP its default TLS, whose cost is then part of
    # epp minus floor, as a deployment pays it
    target.pop("transport_socket", None)
    (group,) = target["load_assignment"]["endpoints"]
    (endpoint,) = group["lb_endpoints"]
    endpoint["endpoint"]["address"]["socket_address"] = {"address": epp[0], "port_value": epp[1]}
    config["static_resources"]["clusters"].append(target)


def _answers(endpoint: str) -> tuple[Any, Any]:
    """The floor's picker, whatever carries it: ``answer(read, write, eof)`` answers one
    ext_proc stream (``read`` returns each ProcessingRequest, ``eof`` at the stream's end;
    ``write`` takes a serialized ProcessingResponse); and the request type's parser."""
    from envoy.config.core.v3.base_pb2 import HeaderValueOption
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from google.protobuf.struct_pb2 import Struct

    Response = ep.ProcessingResponse
    # the answers that never change, serialized once: the pick (header and dynamic metadata,
    # route cache cleared), the answer's headers CONTINUE, the trailers'
    header = "x-gateway-destination-endpoint"
    r = Response()
    common = r.request_headers.response
    o = common.header_mutation.set_headers.add(
        append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    )
    o.header.key, o.header.raw_value = header, endpoint.encode()
    common.clear_route_cache = True
    meta = Struct()
    meta.update({"envoy.lb": {header: endpoint}})
    r.dynamic_metadata.CopyFrom(meta)
    pick = r.SerializeToString()
    resp_headers = Response(response_headers=ep.HeadersResponse()).SerializeToString()
    req_trailers = Response(request_trailers=ep.TrailersResponse()).SerializeToString()
    resp_trailers = Response(response_trailers=ep.TrailersResponse()).SerializeToString()

    def echo(body: Any, *, request: bool) -> bytes:
        r = Response()
        chunk = (r.request_body if request else r.response_body).response.body_mutation
        chunk.streamed_response.SetInParent()
        chunk.streamed_response.body = body.body
        chunk.streamed_response.end_of_stream = body.end_of_stream
        return r.SerializeToString()

    async def answer(read: Any, write: Any, eof: Any) -> None:
        m = await read()
        if m is eof:
            return
        chunks, trailers = [], False
        if not m.request_headers.end_of_stream:
            while (m := await read()) is not eof:
                if m.HasField("request_body"):
                    chunks.append(m.request_body)
                    if m.request_body.end_of_stream:
                        break
                else:  # the request's trailers
                    trailers = True
                    break
        await write(pick)
        for c in chunks:
            await write(echo(c, request=True))
        if trailers:
            await write(req_trailers)
        while (m := await read()) is not eof:
            kind = m.WhichOneof("request")
            if kind == "response_headers":
                await write(resp_headers)
                if m.response_headers.end_of_stream:
                    return
            elif kind == "response_body":
                await write(echo(m.response_body, request=False))
                if m.response_body.end_of_stream:
                    return
            else:  # the answer's trailers
                await write(resp_trailers)
                return

    return answer, ep.ProcessingRequest.FromString


async def serve(endpoint: str) -> None:
    """The floor on grpc.aio, as the router's EPP is served."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    answer, parse = _answers(endpoint)
    service = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name

    async def process(_: Any, context: Any) -> None:
        await answer(context.read, context.write, grpc.aio.EOF)

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.stream_stream_rpc_method_handler(
        process, request_deserializer=parse, response_serializer=bytes
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {"Process": handler}),)
    )
    checks = health.aio.HealthServicer()
    for name in ("", service):
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"EPP listening on 127.0.0.1:{port}", flush=True)  # (kvrouter.gateway.EPP_READY)
    await server.wait_for_termination()


async def serve_h2(endpoint: str) -> None:
    """The same floor without a gRPC library: gRPC's framing on ``h2`` in an asyncio protocol
    on the loop, a task per stream as grpc.aio runs it. For measurement only: it trusts its
    peer (one Envoy on loopback), answers no compression, deadline or flow-control stall, and
    serves health as SERVING for any name."""
    import asyncio
    import struct

    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions

    answer, parse = _answers(endpoint)
    eof = object()
    head = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    ok = [(b"grpc-status", b"0")]
    serving = b"\x00\x00\x00\x00\x02\x08\x01"  # HealthCheckResponse{status: SERVING}, framed
    check = b"/grpc.health.v1.Health/Check"

    class Stream:
        def __init__(self) -> None:
            self.queue: asyncio.Queue[Any] = asyncio.Queue()
            self.buf = b""
            self.started = False
            self.task: asyncio.Future[None] | None = None

    class Connection(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.h2 = h2.connection.H2Connection(
                h2.config.H2Configuration(client_side=False, header_encoding=None)
            )
            self.h2.initiate_connection()
            self.streams: dict[int, Stream] = {}
            self.flush()

        def flush(self) -> None:
            data = self.h2.data_to_send()
            if data:
                self.transport.write(data)

        def data_received(self, data: bytes) -> None:
            for ev in self.h2.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    if dict(ev.headers).get(b":path") == check:
                        self.h2.send_headers(ev.stream_id, head)
                        self.h2.send_data(ev.stream_id, serving)
                        self.h2.send_headers(ev.stream_id, ok, end_stream=True)
                        continue
                    st = self.streams[ev.stream_id] = Stream()
                    st.task = asyncio.ensure_future(self.run(ev.stream_id, st))
                elif isinstance(ev, h2.events.DataReceived):
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    st = self.streams.get(ev.stream_id)
                    if st is None:
                        continue
                    st.buf += ev.data
                    while len(st.buf) >= 5:
                        n = struct.unpack_from(">I", st.buf, 1)[0]
                        if len(st.buf) < 5 + n:
                            break
                        st.queue.put_nowait(parse(st.buf[5 : 5 + n]))
                        st.buf = st.buf[5 + n :]
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    st = self.streams.get(ev.stream_id)
                    if st is not None:
                        st.queue.put_nowait(eof)
            self.flush()

        async def run(self, sid: int, st: Stream) -> None:
            async def write(message: bytes) -> None:
                if not st.started:
                    self.h2.send_headers(sid, head)
                    st.started = True
                self.h2.send_data(sid, struct.pack(">BI", 0, len(message)) + message)
                self.flush()

            try:
                await answer(st.queue.get, write, eof)
                if not st.started:
                    self.h2.send_headers(sid, head)
                self.h2.send_headers(sid, ok, end_stream=True)
                self.flush()
            except h2.exceptions.StreamClosedError:
                pass  # Envoy reset the stream: nothing more to say on it
            finally:
                self.streams.pop(sid, None)

    server = await asyncio.get_running_loop().create_server(Connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(f"EPP listening on 127.0.0.1:{port}", flush=True)  # (kvrouter.gateway.EPP_READY)
    await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--endpoint", required=True, help="host:port every request is sent to")
    ap.add_argument(
        "--transport",
        choices=("grpc", "h2"),
        default="grpc",
        help="grpc: grpc.aio, as the router (default); h2: gRPC's framing on h2, no gRPC library",
    )
    args = ap.parse_args()
    import uvloop

    uvloop.run((serve_h2 if args.transport == "h2" else serve)(args.endpoint))


if __name__ == "__main__":
    main()
