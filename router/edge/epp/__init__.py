"""The Gateway API Inference Extension endpoint picker (EPP): a third front door, next to the
OpenAI proxy and ``/route``, for Envoy's ``ext_proc`` filter. Envoy asks which worker should serve
each request; the picker places it with the same :class:`router.placement.Placer` and answers
``x-gateway-destination-endpoint: ip:port`` (an ORIGINAL_DST cluster routes on it), then watches
the answer stream by to account the request until it ends. On when ``epp.port`` is set (the
``epp`` extra: grpcio, grpcio-health-checking, xds-protos).

- ``server``: :class:`router.edge.epp.server.EppServer`, the gRPC server, its health service and
  lifecycle (what the app's lifespan starts; importing this package imports no gRPC);
- ``stream``: one ext_proc stream, from the request's headers to the end of its answer;
- ``messages``: reading Envoy's messages and building the picker's answers (pure);
- ``limits``: the streams taken at once, what the others get, and gRPC's limits to match;
- ``tls``: the port's transport, TLS by default (a self-signed certificate made at start);
- ``errors``: the streams closed with a gRPC status.
"""
