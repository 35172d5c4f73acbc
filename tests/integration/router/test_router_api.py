"""The router's HTTP contract: errors, dead workers, readiness, the worker registry API, metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from router_fakeworker import wait_for

BS = 16


def err(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


@pytest.mark.parametrize(
    "serve", ["direct", "asgi"]
)  # router.edge.server's config / uvicorn defaults
async def test_malformed_bodies_get_documented_4xx(workers, router, http, serve):
    a = await workers("a")
    r = await router([a], proxy={"max_body_bytes": 4096}, plain_asgi=serve == "asgi")
    u = r.url
    assert "JSON" in err(await http.post(u + "/route", content=b"{not json"), 400)
    assert "token_ids" in err(await http.post(u + "/route", json={"token_ids": "abc"}), 422)
    assert "token_ids[1]" in err(await http.post(u + "/route", json={"token_ids": [1, "x"]}), 422)
    assert "account" in err(
        await http.post(u + "/route", json={"token_ids": [1], "account": 3}), 422
    )
    assert "required" in err(await http.post(u + "/route", json={}), 400)
    assert "object" in err(await http.post(u + "/route", json=[1, 2]), 422)
    assert "nope" in err(await http.post(u + "/route", json={"prompt": "x", "model": "nope"}), 404)
    # over the limit with an honest Content-Length, and streamed without one
    err(await http.post(u + "/route", json={"token_ids": [1] * 4000}), 413)

    async def chunks():
        for _ in range(100):
            yield b"[" + b"1," * 50

    err(await http.post(u + "/route", content=chunks()), 413)
    # the OpenAI endpoints
    assert "prompt" in err(await http.post(u + "/v1/completions", json={"model": "x"}), 400)
    assert "prompt" in err(await http.post(u + "/v1/completions", json={"prompt": 5}), 422)
    assert "stream" in err(
        await http.post(u + "/v1/completions", json={"prompt": "x", "stream": "yes"}), 422
    )
    assert "messages" in err(await http.post(u + "/v1/chat/completions", json={}), 400)
    assert "messages[0].role" in err(
        await http.post(u + "/v1/chat/completions", json={"messages": [{"content": "x"}]}), 422
    )
    assert "fake" not in err(
        await http.post(u + "/v1/completions", json={"prompt": "x", "model": "other"}), 404
    )
    err(await http.get(u + "/no/such/path"), 404)
    err(await http.get(u + "/route"), 405)
    assert not a.requests  # nothing malformed reached the worker


async def test_dead_worker_retry_then_503_never_hang(workers, router, http):
    a, b = await workers("a"), await workers("b")
    # health checks far apart: the proxy itself must notice the dead worker
    r = await router([a, b], health={"interval_s": 60.0})
    tokens = list(("x" * 320).encode())
    a.store(tokens)
    await wait_for(lambda: r.matched(tokens, "a") == 20, 20, "events applied")
    await a.stop_http()  # a still looks best (its cache) but refuses connections
    t0 = time.monotonic()
    resp = await http.post(r.url + "/v1/completions", json={"prompt": "x" * 320})
    assert resp.status_code == 200 and resp.headers["x-kvrouter-worker"] == "b"
    assert r.state.registry.workers["a"].healthy is False  # passive health marked it at once
    await b.stop_http()
    resp = await http.post(r.url + "/v1/completions", json={"prompt": "x" * 320, "stream": True})
    assert "worker" in err(resp, 503)
    resp = await http.post(r.url + "/route", json={"prompt": "y"})
    err(resp, 503)
    assert time.monotonic() - t0 < 15
    assert r.state.placer.inflight == 0
    text = (await http.get(r.url + "/metrics")).text
    assert 'kvrouter_proxy_retries_total{reason="ConnectError",worker="a"} 1.0' in text
    assert 'kvrouter_worker_healthy{worker="a"} 0.0' in text


async def test_worker_that_hangs_times_out(workers, router, http):
    a = await workers("a", first_token_delay_s=60)
    r = await router([a], proxy={"read_timeout_s": 0.5, "retries": 0})
    t0 = time.monotonic()
    resp = await http.post(r.url + "/v1/completions", json={"prompt": "hello"})
    assert "ReadTimeout" in err(resp, 504)
    assert time.monotonic() - t0 < 10


async def test_max_inflight_answers_429(workers, router, http):
    a = await workers("a", first_token_delay_s=60)
    r = await router([a], proxy={"max_inflight": 1})
    slow = asyncio.create_task(http.post(r.url + "/v1/completions", json={"prompt": "hello"}))
    await wait_for(lambda: a.running == 1, 20, "first request in flight")
    err(await http.post(r.url + "/v1/completions", json={"prompt": "again"}), 429)
    slow.cancel()
    try:
        await slow
    except asyncio.CancelledError:
        pass
    await wait_for(lambda: r.state.placer.inflight == 0, 20, "slot freed")


async def test_ready_only_after_replay(workers, router, http):
    a = await workers("a", replay_mode="hold")
    a.store(list(range(64)))  # published before the router exists: only replay can bring it
    r = await router([a], ready=False, subscriber={"replay_timeout_s": 30.0})
    await wait_for(lambda: a.replay_requests, 20, "replay requested")
    resp = await http.get(r.url + "/ready")
    assert resp.status_code == 503 and resp.json()["waiting_for"] == ["a"]
    await a.release_replay()
    await r.wait_ready()
    assert (await http.get(r.url + "/ready")).status_code == 200
    body = (await http.post(r.url + "/route", json={"token_ids": list(range(64))})).json()
    assert body["candidates"][0]["matched_by_tier"]["GPU"] == 4  # the replayed store


async def test_workers_api_needs_admin_key(workers, router, http):
    a, b = await workers("a"), await workers("b")
    r = await router([a], admin_key="s3cret")
    u = r.url
    auth = {"Authorization": "Bearer s3cret"}
    err(await http.get(u + "/workers"), 401)  # it shows internal endpoints
    listed = (await http.get(u + "/workers", headers=auth)).json()["workers"]
    assert [w["id"] for w in listed] == ["a"] and listed[0]["healthy"] is True
    assert listed[0]["ranks"][0]["subscriber"]["replay_done"] is True
    new = b.spec()
    err(await http.post(u + "/workers", json=new), 401)
    err(await http.post(u + "/workers", json=new, headers={"Authorization": "Bearer nope"}), 401)
    auth = {"Authorization": "Bearer s3cret"}
    assert "url" in err(
        await http.post(u + "/workers", json={**new, "url": "ftp://x"}, headers=auth), 400
    )
    # no events_endpoint: read from the worker's /kv_event_sources, as for a configured one;
    # a worker nobody can reach is refused, naming what to give (issue 36: or events=none)
    assert "events=none" in err(
        await http.post(u + "/workers", json={"id": "c", "url": "http://x"}, headers=auth), 400
    )
    resp = await http.post(u + "/workers", json=new, headers=auth)
    assert resp.status_code == 201 and resp.json()["id"] == "b"
    err(await http.post(u + "/workers", json=new, headers=auth), 409)
    await r.wait_ready()
    b.store(list(range(32)))
    await wait_for(lambda: r.matched(list(range(32)), "b") == 2, 20, "new worker's events")
    err(await http.delete(u + "/workers/b"), 401)
    err(await http.delete(u + "/workers/zzz", headers=auth), 404)
    assert (await http.delete(u + "/workers/b", headers=auth)).status_code == 200
    listed = (await http.get(u + "/workers", headers=auth)).json()["workers"]
    assert [w["id"] for w in listed] == ["a"]
    body = (await http.post(u + "/route", json={"token_ids": list(range(32))})).json()
    assert [c["worker_id"] for c in body["candidates"]] == ["a"]


async def test_metrics_and_health(workers, router, http):
    a = await workers("a")
    r = await router([a], scoring={"running_weight": 1.0})
    assert (await http.get(r.url + "/health")).json() == {"status": "ok"}
    a.store(list(range(48)), medium="CPU")
    await wait_for(lambda: r.matched(list(range(48)), "a") == 3, 20, "the store applied")
    await wait_for(lambda: r.state.registry.workers["a"].scraped is not None, 20, "scrape")
    assert r.state.registry.workers["a"].scraped.kv_usage == 0.25
    await http.post(r.url + "/route", json={"token_ids": list(range(48))})
    text = (await http.get(r.url + "/metrics")).text
    for name in (
        "kvrouter_route_latency_seconds_bucket",
        "kvrouter_decision_latency_seconds_count",
        "kvrouter_matched_block_ratio_bucket",
        'kvrouter_route_decisions_total{kind="route",worker="a"} 1.0',
        'kvrouter_events_applied_total{dp_rank="0",type="BlockStored",worker="a"} 1.0',
        'kvrouter_index_blocks{dp_rank="0",tier="CPU_PINNED",worker="a"} 3.0',
        'kvrouter_subscriber_connected{dp_rank="0",worker="a"} 1.0',
        "kvrouter_event_lag_seconds",
        "kvrouter_events_malformed_total",
        "kvrouter_events_gaps_total",
    ):
        assert name in text, name


async def test_worker_serving_traffic_without_events_is_flagged(workers, router, http):
    quiet = await workers("quiet", publish_on_request=False)
    r = await router([quiet], health={"interval_s": 0.2, "stale_events_s": 10.0})
    view = (await http.get(r.url + "/workers")).json()["workers"][0]
    assert view["events_stale"] is False  # no traffic yet: nothing to say
    assert (
        await http.post(r.url + "/v1/completions", json={"prompt": "x" * 64})
    ).status_code == 200
    routed = time.monotonic()

    async def flagged() -> bool:
        return (await http.get(r.url + "/workers")).json()["workers"][0]["events_stale"]

    deadline = time.monotonic() + 20
    while not await flagged():
        assert time.monotonic() < deadline, "never flagged"
        await asyncio.sleep(0.05)
    text = (await http.get(r.url + "/metrics")).text
    assert 'kvrouter_worker_events_stale{worker="quiet"} 1.0' in text
    quiet.store(list(range(16)))  # an event arrives: no longer stale
    deadline = time.monotonic() + 20
    while await flagged():
        assert time.monotonic() < deadline, "still flagged after an event"
        await asyncio.sleep(0.05)
    assert time.monotonic() - routed < 10.0  # the event cleared it, not the traffic ageing out


async def test_openapi_document_describes_what_the_router_answers(workers, router, http):
    """/openapi.json is built from the Structs the handlers use: a real /route request and its
    answer validate against it, a wrong body does not, and /docs renders it; docs: false → 404."""
    import jsonschema

    a = await workers("a")
    r = await router([a])
    doc = (await http.get(r.url + "/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/route", "/v1/completions", "/v1/chat/completions", "/workers", "/ready"):
        assert path in doc["paths"], path
    schemas = doc["components"]["schemas"]

    def check(instance: object, name: str) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        jsonschema.validate(instance, schema)

    body = {"token_ids": list(range(40)), "account": False, "cache_salt": "t1"}
    check(body, "RouteRequest")
    with pytest.raises(jsonschema.ValidationError):
        check({"token_ids": [-1]}, "RouteRequest")  # the router's 422 in the document too
    answer = (await http.post(r.url + "/route", json=body)).json()
    check(answer, "RouteOut")
    assert set(answer["candidates"][0]) == set(schemas["CandidateOut"]["properties"])
    refused = await http.post(r.url + "/route", json={"token_ids": [-1]})
    err(refused, 422)
    check(refused.json(), "ErrorBody")
    page = await http.get(r.url + "/docs")
    assert page.status_code == 200 and "/openapi.json" in page.text

    closed = await router([a], server={"docs": False})
    assert (await http.get(closed.url + "/docs")).status_code == 404
    assert (await http.get(closed.url + "/openapi.json")).status_code == 404
