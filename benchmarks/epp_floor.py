"""The floor of a Python endpoint picker: a grpc.aio ext_proc server on uvloop that answers
Envoy's message sequence with the least work, for ``bench_epp.py --floor``. What it costs is
grpc.aio's (and the event loop's) own price per stream and per message; the router's EPP minus
this is what kvrouter adds.

    python benchmarks/epp_floor.py --endpoint 127.0.0.1:8000   # prints "EPP listening on ..."

It speaks the same protocol as ``router.edge.epp`` with Envoy's FULL_DUPLEX_STREAMED bodies both
ways: the request headers, body and trailers read to the end, then one answer naming the fixed
``--endpoint`` (header and dynamic metadata, route cache cleared), the body echoed chunk by
chunk, the trailers' answer; in the response phase every message answered at once (headers
CONTINUE, body chunks echoed) until the answer's end. No placement, no metrics, no access log,
no deadline; the constant answers are serialized once and sent as bytes. It also serves the
standard ``grpc.health.v1`` service (Envoy health-checks its EPP cluster).

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
    (group,) = target["load_assignment"]["endpoints"]
    (endpoint,) = group["lb_endpoints"]
    endpoint["endpoint"]["address"]["socket_address"] = {"address": epp[0], "port_value": epp[1]}
    config["static_resources"]["clusters"].append(target)


async def serve(endpoint: str) -> None:
    import grpc
    from envoy.config.core.v3.base_pb2 import HeaderValueOption
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from google.protobuf.struct_pb2 import Struct
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    Response = ep.ProcessingResponse
    service = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
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
    EOF = grpc.aio.EOF

    def echo(body: Any, *, request: bool) -> bytes:
        r = Response()
        chunk = (r.request_body if request else r.response_body).response.body_mutation
        chunk.streamed_response.SetInParent()
        chunk.streamed_response.body = body.body
        chunk.streamed_response.end_of_stream = body.end_of_stream
        return r.SerializeToString()

    async def process(_: Any, context: Any) -> None:
        read, write = context.read, context.write
        m = await read()
        if m is EOF:
            return
        chunks, trailers = [], False
        if not m.request_headers.end_of_stream:
            while (m := await read()) is not EOF:
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
        while (m := await read()) is not EOF:
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

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.stream_stream_rpc_method_handler(
        process, request_deserializer=ep.ProcessingRequest.FromString, response_serializer=bytes
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--endpoint", required=True, help="host:port every request is sent to")
    args = ap.parse_args()
    import uvloop

    uvloop.run(serve(args.endpoint))


if __name__ == "__main__":
    main()
