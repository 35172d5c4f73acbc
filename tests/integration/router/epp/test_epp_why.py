"""Why this worker through the endpoint picker (``scoring.explain``): the answer's head that
Envoy is told to set carries ``x-kvrouter-why``, and the picker's access line its ``why`` — a
real router with its EPP on port 0 (TLS), a real gRPC client playing Envoy, fake workers."""

from __future__ import annotations

import json
import logging

from epp_envoy import headers_request
from router_fakeworker import wait_for

from router.edge.epp.messages import endpoint_of

PREFIX = "You are a careful assistant. " * 20  # 580 bytes = 36 full blocks
JSON = {"content-type": "application/json"}


def access_lines(caplog, path: str) -> list[dict]:
    return [
        x.access  # type: ignore[attr-defined]
        for x in caplog.records
        if x.name == "kvrouter.access" and x.access["path"] == path  # type: ignore[attr-defined]
    ]


async def test_the_picker_says_why_on_the_answer_and_in_its_access_line(workers, epp, http, caplog):
    caplog.set_level(logging.INFO, logger="kvrouter.access")
    a = await workers("a", publish_on_request=False)
    b = await workers("b", publish_on_request=False)
    r, envoy = await epp([a, b], scoring={"explain": True})
    b.store(list(PREFIX.encode()))
    await wait_for(lambda: r.matched(list(PREFIX.encode()), "b") == 36, 10, "b's events")

    body = json.dumps({"model": "fake-model", "prompt": PREFIX + "x", "max_tokens": 2}).encode()
    p = await envoy.pick("/v1/completions", body)
    assert p.endpoint == endpoint_of(b.url)
    assert "x-kvrouter-why" not in p.set_headers  # (for the client, not for the worker)
    status, _, echoes = await p.forward(http, "/v1/completions", body, JSON)
    assert status == 200
    head = {
        h.header.key: h.header.raw_value.decode()
        for h in echoes[0].response_headers.response.header_mutation.set_headers
    }
    why = head["x-kvrouter-why"]
    assert why.startswith("worker=b blocks=GPU:36 of=36 credit=36.0 cost=")
    assert "; next=a cost=" in why and " margin=" in why
    margin = float(why.rpartition("margin=")[2])
    assert margin > 0
    await wait_for(lambda: access_lines(caplog, "/v1/completions"), 10, "the access line")
    assert access_lines(caplog, "/v1/completions")[0]["why"] == why


async def test_the_picker_says_nothing_more_by_default(workers, epp, http, caplog):
    caplog.set_level(logging.INFO, logger="kvrouter.access")
    a = await workers("a")
    _, envoy = await epp([a])
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2}).encode()
    p = await envoy.pick("/v1/completions", body)
    await p.call.write(headers_request([(":status", "200")], end=True, response=True))
    reply = await p.call.read()
    head = {h.header.key for h in reply.response_headers.response.header_mutation.set_headers}
    assert "x-kvrouter-worker" in head and "x-kvrouter-why" not in head
    await wait_for(lambda: access_lines(caplog, "/v1/completions"), 10, "the access line")
    assert "why" not in access_lines(caplog, "/v1/completions")[0]
