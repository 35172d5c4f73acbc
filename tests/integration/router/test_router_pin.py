"""A request pinned to one worker (``x-kvrouter-worker`` with the admin key: ``kvrouter check``'s
probes), over a real router and fake workers: honoured only for the admin, never retried
elsewhere; and what the check reads besides: ``/route``'s ``prompt_tokens`` and each rank's KV
``capacity`` and ``page`` in ``GET /workers``."""

from __future__ import annotations

import json

from router_fakeworker import wait_for

PREFIX = "You are a careful assistant. " * 20  # 580 bytes = 36 full blocks
ADMIN = "admin-secret"


def body(prompt: str = PREFIX) -> bytes:
    return json.dumps({"model": "fake-model", "prompt": prompt, "max_tokens": 2}).encode()


async def test_the_admin_pins_a_request_to_a_worker_the_index_would_not_pick(workers, router, http):
    a = await workers("a")
    b = await workers("b")
    r = await router([a, b], admin_key=ADMIN, api_keys=["client-key"])
    tokens = list(PREFIX.encode())
    a.store(tokens)
    await wait_for(lambda: r.matched(tokens, "a") == 36, 10, "a's events")
    client = {"authorization": "Bearer client-key"}

    got = await http.post(r.url + "/v1/completions", content=body(), headers=client)
    assert got.status_code == 200 and got.headers["x-kvrouter-worker"] == "a"

    pin = {**client, "x-kvrouter-worker": "b", "x-kvrouter-admin-key": ADMIN}
    got = await http.post(r.url + "/v1/completions", content=body(), headers=pin)
    assert got.status_code == 200, got.text
    assert got.headers["x-kvrouter-worker"] == "b"
    assert got.headers["x-kvrouter-matched-blocks"] == "0"
    assert len(b.requests) == 1
    # the admin key never reaches the worker
    assert all("x-kvrouter-admin-key" not in h for h in b.request_headers)

    # a pinned worker that fails is not replaced by another
    await b.stop_http()
    got = await http.post(r.url + "/v1/completions", content=body(), headers=pin)
    assert got.status_code in (502, 503), got.text
    assert len(a.requests) == 1


async def test_a_pin_without_the_admin_key_is_refused_and_an_unknown_worker_named(
    workers, router, http
):
    a = await workers("a")
    r = await router([a], admin_key=ADMIN)
    url = r.url + "/v1/completions"
    got = await http.post(url, content=body(), headers={"x-kvrouter-worker": "a"})
    assert got.status_code == 401 and "x-kvrouter-admin-key" in got.json()["error"]["message"]
    wrong = {"x-kvrouter-worker": "a", "x-kvrouter-admin-key": "nope"}
    assert (await http.post(url, content=body(), headers=wrong)).status_code == 401
    unknown = {"x-kvrouter-worker": "zz", "x-kvrouter-admin-key": ADMIN}
    got = await http.post(url, content=body(), headers=unknown)
    assert got.status_code == 404 and "'zz'" in got.json()["error"]["message"]
    assert a.requests == []


async def test_no_admin_key_configured_no_pin(workers, router, http):
    a = await workers("a")
    r = await router([a], admin_open=False)
    got = await http.post(
        r.url + "/v1/completions", content=body(), headers={"x-kvrouter-worker": "a"}
    )
    assert got.status_code == 403 and "admin_key" in got.json()["error"]["message"]
    # open admin endpoints (a trusted network): the pin is open too
    r2 = await router([a])
    got = await http.post(
        r2.url + "/v1/completions", content=body(), headers={"x-kvrouter-worker": "a"}
    )
    assert got.status_code == 200 and got.headers["x-kvrouter-worker"] == "a"


async def test_route_tells_the_prompt_length_and_workers_their_kv_size(workers, router, http):
    a = await workers("a", kv_capacity=4096)
    b = await workers("b", block_size=32)
    r = await router([a, b])
    b.store(list(PREFIX.encode()))
    await wait_for(lambda: r.matched(list(PREFIX.encode()), "b") > 0, 10, "b's events")

    got = (await http.post(r.url + "/route", content=body(PREFIX + "xyz"))).json()
    assert got["prompt_tokens"] == len(PREFIX) + 3 and got["request_blocks"] == 36

    # the health checker scrapes a's /metrics; the index holds what it reported
    await wait_for(lambda: r.state.index.worker(("a", 0)).capacity, 10, "a's capacity")
    ws = (await http.get(r.url + "/workers")).json()["workers"]
    ranks = {w["id"]: w["ranks"][0] for w in ws}
    assert ranks["a"]["capacity"] == {"GPU": 4096} and ranks["a"]["page"] == 0
    assert ranks["b"]["capacity"] is None and ranks["b"]["page"] == 32
