"""The endpoint picker's picks, end to end: a real router (uvicorn, fake workers publishing KV
events over ZMQ) with its EPP on port 0, and a real gRPC client doing Envoy's part — the request
phase, then the request forwarded to the endpoint picked and its answer streamed back; and a
mixed fleet (one worker with events, one without: issue 36) picked through it."""

from __future__ import annotations

import json
import random

from envoy.service.ext_proc.v3.external_processor_pb2 import HttpTrailers, ProcessingRequest
from epp_envoy import headers_request, metric
from router_fakeworker import wait_for
from test_router_approximate import BS, no_events, text

from router.edge.epp.messages import endpoint_of

PREFIX = "You are a careful assistant. " * 20  # 580 bytes = 36 full blocks
JSON = {"content-type": "application/json"}


def completion(prompt: str, **extra: object) -> bytes:
    return json.dumps({"model": "fake-model", "prompt": prompt, **extra}).encode()


async def idle(r, *names: str) -> None:
    """Every flight ended: nothing in flight, no load ticket left on any worker."""
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "no request in flight")
    for n in names:
        assert r.state.placer.load.inflight(n) == 0


async def test_pick_sets_the_endpoint_header_metadata_and_clears_the_route_cache(
    workers, epp, http
):
    a = await workers("a")
    b = await workers("b")
    r, envoy = await epp([a, b])
    ends = {endpoint_of(a.url): "a", endpoint_of(b.url): "b"}
    body = completion(PREFIX + "one")
    p = await envoy.pick("/v1/completions", body, headers=[("x-request-id", "req-1")])
    assert p.first.HasField("request_headers"), p.first
    assert p.first.request_headers.response.clear_route_cache
    picked = p.endpoint
    assert picked in ends
    # the protocol's two channels carry the same value
    assert p.metadata == {"envoy.lb": {"x-gateway-destination-endpoint": picked}}
    assert p.set_headers["content-length"] == str(len(body))
    assert "x-request-id" not in p.set_headers  # the client's own id is kept as it is
    assert "x-data-parallel-rank" in p.removed  # one rank per worker: no client's say
    assert p.body == body and p.trailers is None
    assert r.state.placer.inflight == 1 and r.state.placer.load.inflight(ends[picked]) == 1

    status, answer, echoes = await p.forward(http, "/v1/completions", body, JSON)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == "tok tok tok tok"
    head = {
        h.header.key: h.header.raw_value.decode()
        for h in echoes[0].response_headers.response.header_mutation.set_headers
    }
    assert head["x-kvrouter-worker"] == ends[picked] and head["x-request-id"] == "req-1"
    assert head["x-kvrouter-matched-blocks"] == "0"
    worker = a if ends[picked] == "a" else b
    assert worker.requests[-1]["prompt"] == PREFIX + "one"
    await idle(r, "a", "b")
    text = (await http.get(r.url + "/metrics")).text
    w = ends[picked]
    assert metric(text, "kvrouter_route_decisions_total", worker=w, kind="epp") == 1
    labels = {"worker": w, "endpoint": "completions", "status": "200"}
    assert metric(text, "kvrouter_proxied_requests_total", **labels) == 1
    assert metric(text, "kvrouter_time_to_first_byte_seconds_count", worker=w) == 1
    assert metric(text, "kvrouter_inflight_requests", worker=w) == 0


async def test_a_large_body_is_echoed_byte_identical_in_order(workers, epp):
    a = await workers("a")
    r, envoy = await epp([a])
    rng = random.Random(7)
    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(300_000))
    body = completion(prompt)
    p = await envoy.pick("/v1/completions", body, chunk=16384)
    assert p.endpoint == endpoint_of(a.url)
    assert p.body == body  # every byte, in order
    assert p.body_messages == -(-len(body) // 16384)  # one echo per chunk, the last ends it
    await p.call.write(headers_request([(":status", "200")], end=True, response=True))
    assert (await p.call.read()).HasField("response_headers")
    await idle(r, "a")


async def test_a_bodiless_request_is_placed_by_load(workers, epp, http):
    a = await workers("a")
    r, envoy = await epp([a])
    p = await envoy.pick("/v1/models", None, method="GET")
    assert p.endpoint == endpoint_of(a.url) and p.body_messages == 0
    assert "content-length" not in p.set_headers
    await p.call.write(headers_request([(":status", "200")], end=True, response=True))
    assert (await p.call.read()).HasField("response_headers")
    await idle(r, "a")
    text = (await http.get(r.url + "/metrics")).text
    labels = {"worker": "a", "endpoint": "other", "status": "200"}
    assert metric(text, "kvrouter_proxied_requests_total", **labels) == 1


async def test_a_cached_prefix_follow_up_lands_on_the_worker_holding_it(workers, epp, http):
    a = await workers("a")
    b = await workers("b")
    r, envoy = await epp([a, b])
    ends = {endpoint_of(a.url): "a", endpoint_of(b.url): "b"}
    body = completion(PREFIX + "one")
    p = await envoy.pick("/v1/completions", body)
    first = ends[p.endpoint]
    await p.forward(http, "/v1/completions", body, JSON)  # the worker stores, and announces
    await wait_for(lambda: r.matched(list(PREFIX.encode()), first) == 36, 10, "events")
    for i in range(3):
        body = completion(
            f"{PREFIX}follow-up {i}", stream=True, stream_options={"include_usage": True}
        )
        p = await envoy.pick("/v1/completions", body)
        assert ends[p.endpoint] == first
        status, answer, echoes = await p.forward(http, "/v1/completions", body, JSON)
        assert status == 200 and b"data: [DONE]" in answer
        head = echoes[0].response_headers.response.header_mutation.set_headers
        assert {h.header.key: h.header.raw_value for h in head}[
            "x-kvrouter-matched-blocks"
        ] == b"36"
    await idle(r, "a", "b")
    text = (await http.get(r.url + "/metrics")).text
    # the SSE usage chunk was read on its way back: the worker's cached tokens were counted
    assert metric(text, "kvrouter_cached_tokens_actual_total", worker=first) == 3 * 36 * 16


async def test_the_subset_hint_is_obeyed_and_an_ineligible_one_is_503(workers, epp, http):
    a = await workers("a")
    b = await workers("b")
    r, envoy = await epp([a, b])
    eb = endpoint_of(b.url)
    for i, subset in enumerate(([eb], f"10.9.9.9:80, {eb}", ["10.9.9.9:80", f"10.0.0.1:1,{eb}"])):
        p = await envoy.pick("/v1/completions", completion(f"{PREFIX}{i}"), subset=subset)
        assert p.endpoint == eb, subset
        await p.call.write(headers_request([(":status", "200")], end=True, response=True))
        await p.call.read()
    for subset in (["10.9.9.9:80"], [], ""):
        p = await envoy.pick("/v1/completions", completion("x"), subset=subset)
        assert p.immediate is not None, subset
        assert p.immediate.status.code == 503
        err = json.loads(p.immediate.body)["error"]
        assert err["type"] == "service_unavailable" and "subset" in err["message"]
    await idle(r, "a", "b")
    assert not a.requests and not b.requests  # nothing forwarded in this test


async def test_fallbacks_follow_the_pick_in_the_metadata_only(workers, epp):
    a = await workers("a")
    b = await workers("b")
    r, envoy = await epp([a, b], epp={"fallbacks": 2})
    p = await envoy.pick("/v1/completions", completion("hello"))
    both = {endpoint_of(a.url), endpoint_of(b.url)}
    value = p.metadata["envoy.lb"]["x-gateway-destination-endpoint"]
    primary, _, fallback = value.partition(",")
    assert {primary, fallback} == both  # two workers: one fallback, never the pick twice
    # the header holds the pick alone: Envoy's ORIGINAL_DST cluster reads one ip:port there
    assert p.endpoint == primary
    assert r.state.placer.inflight == 1  # only the pick is committed
    p.call.cancel()
    await idle(r, "a", "b")


async def test_trailers_end_the_request_and_are_answered(workers, epp):
    a = await workers("a")
    r, envoy = await epp([a])
    body = completion("with trailers")
    p = await envoy.pick("/v1/completions", body, trailers=True, chunk=8)
    assert p.body == body and p.trailers is not None
    await p.call.write(headers_request([(":status", "200")], response=True))
    await p.call.read()
    await p.call.write(ProcessingRequest(response_trailers=HttpTrailers()))
    assert (await p.call.read()).HasField("response_trailers")
    await idle(r, "a")


async def test_a_data_parallel_worker_gets_the_rank_header(workers, epp, http):
    a = await workers("a")
    r, envoy = await epp([], ready=False, workers=[a.spec(dp_ranks=2, replay_endpoint=None)])
    await wait_for(lambda: r.state.registry.workers["a"].healthy, 20, "a healthy")
    ranks = set()
    for i in range(2):  # two in flight: the second goes to the idle rank
        p = await envoy.pick("/v1/completions", completion(f"rank {i}"))
        assert p.endpoint == endpoint_of(a.url)
        ranks.add(p.set_headers["x-data-parallel-rank"])
        assert "x-data-parallel-rank" not in p.removed
    assert ranks == {"0", "1"}
    assert r.state.placer.inflight == 2


def answered(echoes) -> dict[str, str]:
    """The answer head's headers the picker set (on the first echo of the response phase)."""
    head = echoes[0].response_headers.response.header_mutation.set_headers
    return {h.header.key: h.header.raw_value.decode() for h in head}


async def test_a_mixed_fleet_is_picked_on_each_workers_own_source(workers, epp, http):
    ev, ap = await workers("ev", publish_on_request=False), await workers("ap")
    r, envoy = await epp(workers=[ev.spec(), no_events(ap)])
    ends = {endpoint_of(ev.url): "ev", endpoint_of(ap.url): "ap"}
    held = text("e", 4)
    ev.store(list(held.encode()))  # the evented worker announces a prefix by its real events
    await wait_for(lambda: r.matched(list(held.encode()), "ev") == 4, 5, "the stored event")
    body = completion(held + "|x")
    p = await envoy.pick("/v1/completions", body)
    assert ends[p.endpoint] == "ev"
    await p.forward(http, "/v1/completions", body, JSON)
    # a new prefix the picker placed on the worker without events enters its tree: the pick
    # is a placement like the proxy's (Placer.commit -> sent -> the subscriber applies it)
    sent = None
    for i in range(16):
        prompt = text(chr(ord("a") + i), 4)
        body = completion(prompt)
        p = await envoy.pick("/v1/completions", body)
        await p.forward(http, "/v1/completions", body, JSON)
        if ends[p.endpoint] == "ap":
            sent = prompt
            break
    assert sent is not None, "no new prefix was placed on the worker without events"
    await wait_for(lambda: r.matched(list(sent.encode()), "ap") == 4, 5, "the sent blocks")
    cands = {
        c["worker_id"]: c
        for c in (await http.post(r.url + "/route", json={"prompt": sent + "|r"})).json()[
            "candidates"
        ]
    }
    assert (cands["ev"]["source"], cands["ap"]["source"]) == ("events", "approximate")
    assert (cands["ap"]["matched_by_tier"]["GPU"], cands["ev"]["matched_blocks"]) == (4, 0)
    listed = (await http.get(r.url + "/workers")).json()["workers"]
    assert {w["id"]: w["source"] for w in listed} == {"ev": "events", "ap": "approximate"}
    # a second pick of the prefix goes to its holder on it, and the worker's cache agrees
    body = completion(sent + "|y")
    p = await envoy.pick("/v1/completions", body)
    assert ends[p.endpoint] == "ap"
    status, answer, echoes = await p.forward(http, "/v1/completions", body, JSON)
    assert status == 200 and answered(echoes)["x-kvrouter-matched-blocks"] == "4"
    assert json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS
    # and the evented worker is still scored from its events
    body = completion(held + "|z")
    p = await envoy.pick("/v1/completions", body)
    assert ends[p.endpoint] == "ev"
    status, answer, echoes = await p.forward(http, "/v1/completions", body, JSON)
    assert status == 200 and answered(echoes)["x-kvrouter-matched-blocks"] == "4"
    await idle(r, "ev", "ap")
