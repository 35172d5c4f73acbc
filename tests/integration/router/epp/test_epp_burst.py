"""Issue 37, 8: streams opened at once. gRPC core kept a queue of at most 1,000 calls (3,000 hard)
that the picker had not taken yet and refused the rest, unseen: 9-24 % of 3,000 streams on one
connection failed (the grpc.aio client even reports INTERNAL or CANCELLED). Now every stream is
served, or refused by the picker itself with a clear answer, counted
(:mod:`router.edge.epp.limits`). Real router, real grpc.aio clients, each on its own connection."""

from __future__ import annotations

import asyncio
import collections
import json
import logging

import grpc
from epp_envoy import body_request, headers_request, metric
from router_fakeworker import wait_for

BODY = json.dumps({"model": "fake-model", "prompt": "burst"}).encode()
HEAD = [(":method", "POST"), (":path", "/v1/completions"), (":authority", "gw")]


async def _whole(call) -> str:
    """One request as Envoy sends it, to its end: 'picked', 'imm<status>' or a gRPC status."""
    try:
        await call.write(headers_request(HEAD))
        await call.write(body_request(BODY, True))
        first = await call.read()
        if first.HasField("immediate_response"):
            return f"imm{first.immediate_response.status.code}"
        await call.read()  # the body's echo
        await call.write(headers_request([(":status", "200")], end=True, response=True))
        await call.read()
        await call.done_writing()
        return "picked"
    except grpc.aio.AioRpcError as e:
        return e.code().name
    finally:
        call.cancel()


async def test_2000_streams_at_once_on_one_connection_are_all_served(workers, epp, http):
    a = await workers("a")
    r, envoy = await epp([a])  # epp.max_streams: its default, 4096
    got = collections.Counter(await asyncio.gather(*(_whole(envoy.open()) for _ in range(2000))))
    assert got == {"picked": 2000}, got
    await wait_for(lambda: r.state.placer.inflight == 0 and r.app.state.epp.streams == 0, 10)
    text = (await http.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_proxied_requests_total", worker="a", status="200") == 2000
    assert metric(text, "kvrouter_epp_streams_refused_total") == 0


async def test_past_the_limits_every_stream_is_answered_and_counted(workers, epp, http, caplog):
    """epp.max_streams 8 (so 8 per connection), the backlog 4 x 8: eight connections open eight
    streams each before a word. The first 32 the picker takes stay open; the other 32 are closed
    RESOURCE_EXHAUSTED at once (overload). Then each open one sends its request: 8 are picked,
    24 answered 429 (max_streams). Every one is accounted for, on both sides."""
    caplog.set_level(logging.WARNING, logger="kvrouter.epp")
    a = await workers("a")
    r, first = await epp([a], epp={"max_streams": 8})
    gate = r.app.state.epp.gate
    port = r.app.state.epp_port
    envoys = [first, *(first.another(port) for _ in range(7))]
    try:
        calls = [e.open() for e in envoys for _ in range(8)]
        overload = gate.metrics.refused.labels("overload")
        settled = lambda: gate.open == 32 and overload.value == 32  # noqa: E731
        # (gRPC core refusing any itself, unseen, would leave fewer than 32 counted: the bug)
        await wait_for(settled, 10, "32 streams open, 32 refused by the picker")
        # the picker's last refusals may still be on their way to the clients (CI saw 31 of 32)
        n_done = lambda: sum(c.done() for c in calls)  # noqa: E731
        await wait_for(lambda: n_done() >= 32, 10, "the 32 refusals reach their clients")
        closed = [c for c in calls if c.done()]
        assert len(closed) == 32
        for c in closed:
            assert await c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "overloaded" in (await c.details())
        alive = [c for c in calls if not c.done()]
        got = collections.Counter(await asyncio.gather(*(_first(c) for c in alive)))
        assert got == {"picked": 8, "imm429": 24}, got
        for c in alive:
            c.cancel()
        await wait_for(lambda: r.state.placer.inflight == 0 and gate.open == 0, 10)
    finally:
        for e in envoys[1:]:
            await e.aclose()
    text = (await http.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_epp_streams_refused_total", reason="max_streams") == 24
    assert metric(text, "kvrouter_epp_streams_refused_total", reason="overload") == 32
    assert metric(text, "kvrouter_rejected_requests_total", status="429") == 24
    assert metric(text, "kvrouter_epp_streams") == 0
    lines = [x.getMessage() for x in caplog.records if "EPP refusing streams" in x.getMessage()]
    assert len(lines) == 1, lines  # one line, not one per stream


async def _first(call) -> str:
    """Send one request and read the picker's first answer (the stream stays open)."""
    try:
        await call.write(headers_request(HEAD))
        await call.write(body_request(BODY, True))
        first = await call.read()
        if first.HasField("immediate_response"):
            return f"imm{first.immediate_response.status.code}"
        return "picked"
    except grpc.aio.AioRpcError as e:
        return e.code().name
