"""Prefill/decode disaggregation end to end over real sockets: the PD test workers themselves
(direct HTTP, no router), then kvrouter's proxy, ``/route`` and the EPP in front of them — the
happy paths of vLLM's NIXL exchange and SGLang's bootstrap exchange, and the failure contract
(issue 34; the router's side as ``router/settings/pd.py`` and the PD interface describe it).

Every call is bounded by a timeout; after every router test the router's load ledger is empty
and nothing is in flight (:func:`settled`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_fakeworker import wait_for
from router_pdworker import NIXL_PREFILL_REQUEST, host_port, sse_events

PREFIX = "You are a careful assistant. " * 20  # 580 bytes = 36 full blocks of 16
BLOCKS = 36
T = 15.0  # every client call's bound (seconds)
CHAT = [{"role": "user", "content": PREFIX + "hello"}]
ALWAYS = {"mode": "always", "protocol": "nixl"}


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=T, trust_env=False) as c:
        yield c


def completion(prompt: str = PREFIX + "one", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 4, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": CHAT, "max_tokens": 4, **extra}


def path_of(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head != name and not head.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


async def settled(r: Any) -> None:
    """Nothing in flight and no load ticket left anywhere (no leaked ticket)."""
    placer = r.state.placer
    await wait_for(lambda: not placer.load.items(), 10, "the load ledger empty")

    def inflight() -> int:  # the placement core owns the count (issue 34); the Runtime did
        return getattr(placer, "inflight", None) or getattr(r.state, "inflight", 0)

    await wait_for(lambda: inflight() == 0, 10, "nothing in flight")


def prefill_leg_ok(got: dict[str, Any], sent: dict[str, Any]) -> None:
    """The prefill leg vLLM's NIXL exchange needs: the client's body with one token, not
    streamed, no stream_options/min_tokens, and the prefill request's kv_transfer_params."""
    want = {k: v for k, v in sent.items() if k not in ("stream_options", "min_tokens")}
    want.update(max_tokens=1, stream=False, kv_transfer_params=NIXL_PREFILL_REQUEST)
    if "messages" in sent:
        want["max_completion_tokens"] = 1
    got = dict(got)
    if "max_completion_tokens" in got and "messages" not in sent:
        assert got.pop("max_completion_tokens") == 1
    assert got == want


# ------------------------------------------------------------------ the test workers themselves


async def test_worker_nixl_pair_prefill_pull_and_lease(pd, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    tokens = list((PREFIX + "one").encode())
    body = completion()
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": NIXL_PREFILL_REQUEST}
    a = await client.post(p.url + "/v1/completions", json=leg)
    assert a.status_code == 200, a.text
    kv = a.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == p.engine_id and kv["transfer_mode"] == "pull"
    assert kv["remote_num_tokens"] == len(tokens) and kv["tp_size"] == 1
    assert kv["remote_prefill_cached_tokens"] == 0 and len(kv["remote_block_ids"][0]) == 37
    assert (kv["remote_host"], kv["remote_port"]) == p.side_channel
    assert a.json()["usage"]["completion_tokens"] == 1 and p.issued == [kv]
    assert p.cached_prefix_tokens(tokens) == BLOCKS * 16 and p.seq == 1  # BlockStored published

    b = await client.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": kv})
    assert b.status_code == 200, b.text
    assert b.json()["choices"][0]["text"] == "tok tok tok tok"
    assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P's hit
    assert d.cached_prefix_tokens(tokens) == BLOCKS * 16 and d.pulled == [tokens]
    # the lease is taken once: the same params again fail the load (vLLM: 500)
    again = await client.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": kv})
    assert again.status_code == 500 and "KV load failed" in again.text
    assert [s.outcome.split(":")[0] for s in d.seen] == ["served_remote", "kv_load_failed"]

    # a second prompt sharing the prefix: P's hit travels, and D reports it as its cached tokens
    a2 = await client.post(p.url + "/v1/completions", json={**leg, "prompt": PREFIX + "two"})
    kv2 = a2.json()["kv_transfer_params"]
    assert kv2["remote_prefill_cached_tokens"] == BLOCKS * 16
    b2 = await client.post(
        d.url + "/v1/completions",
        json={**body, "prompt": PREFIX + "two", "stream": True, "kv_transfer_params": kv2,
              "stream_options": {"include_usage": True}},
    )  # fmt: skip
    events = sse_events(b2.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * 16

    # the wrong prompt for a transfer, an unknown engine, a restarted engine, an expired lease
    a3 = await client.post(p.url + "/v1/completions", json=leg)
    kv3 = a3.json()["kv_transfer_params"]
    wrong = {**body, "prompt": PREFIX + "six", "kv_transfer_params": kv3}
    assert (await client.post(d.url + "/v1/completions", json=wrong)).status_code == 500
    bogus = {**kv3, "remote_engine_id": "nope"}
    r = await client.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": bogus})
    assert r.status_code == 500 and "unknown engine" in r.text
    kv4 = (await client.post(p.url + "/v1/completions", json=leg)).json()["kv_transfer_params"]
    p.restart_engine()
    r = await client.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": kv4})
    assert r.status_code == 500 and "unknown engine" in r.text
    now = [1000.0]
    p.clock = lambda: now[0]
    kv5 = (await client.post(p.url + "/v1/completions", json=leg)).json()["kv_transfer_params"]
    now[0] += p.lease_s + 1
    r = await client.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": kv5})
    assert r.status_code == 500 and "lease expired" in r.text
    # a plain request is a whole request on either
    assert (await client.post(d.url + "/v1/completions", json=body)).status_code == 200
    d.kv_load_fail = True
    kv6 = (await client.post(p.url + "/v1/completions", json=leg)).json()["kv_transfer_params"]
    r = await client.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": kv6})
    assert r.status_code == 500 and "injected" in r.text


async def test_worker_faults(pd, client):
    p = await pd.nixl_prefill("p0")
    leg = {**completion(), "max_tokens": 1, "stream": False}
    leg["kv_transfer_params"] = NIXL_PREFILL_REQUEST
    url = p.url + "/v1/completions"
    p.set_fault("500", times=1)
    assert (await client.post(url, json=leg)).status_code == 500
    assert (await client.post(url, json=leg)).status_code == 200  # only once
    p.set_fault("400")
    r = await client.post(url, json=leg)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    p.set_fault("no_params")
    r = await client.post(url, json=leg)
    assert r.status_code == 200 and "kv_transfer_params" not in r.json()
    p.set_fault("reset")
    with pytest.raises(httpx.TransportError):
        await client.post(url, json=leg)
    p.set_fault("hang")
    with pytest.raises(httpx.ReadTimeout):
        await client.post(url, json=leg, timeout=0.3)
    await wait_for(lambda: p.cancelled == 1, 10, "the hung prefill saw the disconnect")
    assert [s.outcome for s in p.seen] == [
        "fault:500", "prefill", "fault:400", "fault:no_params", "fault:reset",
        "fault:hang:cancelled",
    ]  # fmt: skip


async def test_worker_sglang_pair_needs_both_legs_at_once(pd, client):
    p = await pd.sglang_prefill("p0", bootstrap_timeout_s=0.3)
    d = await pd.sglang_decode("d0", waiting_timeout_s=0.3)
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port}
    body = completion(**room, bootstrap_room=7)
    a, b = await asyncio.gather(
        client.post(p.url + "/v1/completions", json=body),
        client.post(d.url + "/v1/completions", json=body),
    )
    assert a.status_code == 200 and a.json()["choices"][0]["text"] == "tok"
    assert b.status_code == 200 and b.json()["choices"][0]["text"] == "tok tok tok tok"
    assert [s.outcome for s in p.seen] == ["prefill"]
    assert [s.outcome for s in d.seen] == ["served_remote"]
    tokens = list((PREFIX + "one").encode())
    assert p.cached_prefix_tokens(tokens) == BLOCKS * 16

    # one leg alone waits for the other, bounded: P's bootstrap and D's transfer time out (500)
    r = await client.post(p.url + "/v1/completions", json={**body, "bootstrap_room": 8})
    assert r.status_code == 500 and "bootstrap failed" in r.text
    r = await client.post(d.url + "/v1/completions", json={**body, "bootstrap_room": 9})
    assert r.status_code == 500 and "timed out" in r.text
    # a decode leg naming no bootstrap server fails at once; a whole request is served
    r = await client.post(d.url + "/v1/completions", json={**body, "bootstrap_port": 1})
    assert r.status_code == 500
    assert (await client.post(d.url + "/v1/completions", json=completion())).status_code == 200
    # a decode leg whose prefill never comes sees the client leave
    d.waiting_timeout_s = 60
    with pytest.raises(httpx.ReadTimeout):
        await client.post(
            d.url + "/v1/completions", json={**body, "bootstrap_room": 10}, timeout=0.3
        )
    await wait_for(lambda: d.cancelled == 1, 10, "the waiting decode saw the disconnect")


# ------------------------------------------------------------------ through the router: NIXL


async def post(client: httpx.AsyncClient, r: Any, body: Any, **kw: Any) -> httpx.Response:
    path = path_of(body) if isinstance(body, dict) else "/v1/completions"
    if isinstance(body, bytes):
        kw["content"] = body
        kw.setdefault("headers", {})["content-type"] = "application/json"
    else:
        kw["json"] = body
    return await asyncio.wait_for(client.post(r.url + path, **kw), T + 5)


async def stream(
    client: httpx.AsyncClient, r: Any, body: dict[str, Any]
) -> tuple[int, httpx.Headers, str]:
    """A streamed call, bounded: (status, headers, the whole body)."""

    async def go() -> tuple[int, httpx.Headers, str]:
        async with client.stream("POST", r.url + path_of(body), json=body) as resp:
            return resp.status_code, resp.headers, (await resp.aread()).decode()

    return await asyncio.wait_for(go(), T + 5)


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_nixl_remote_prefill_then_decode(pd, router, client, kind):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    body = completion(min_tokens=2, temperature=0) if kind == "completions" else chat()
    resp = await post(client, r, body, headers={"x-request-id": "req-pd-1"})
    assert resp.status_code == 200, resp.text
    h = resp.headers
    assert h["x-kvrouter-worker"] == "d0"
    assert h["x-kvrouter-pd"] == "remote" and h["x-kvrouter-pd-reason"]
    assert h["x-kvrouter-prefill-worker"] == "p0"
    assert "x-kvrouter-pd-fallback" not in h
    assert h["x-kvrouter-matched-blocks"] == "0"
    assert len(p.seen) == 1 and len(d.seen) == 1
    prefill_leg_ok(p.seen[0].body, body)
    # the decode leg: the client's original body and P's params verbatim
    assert d.seen[0].body == {**body, "kv_transfer_params": p.issued[0]}
    assert d.seen[0].outcome == "served_remote"
    assert d.seen[0].headers.get("x-request-id") == "req-pd-1"
    out = resp.json()
    text = out["choices"][0]["message"]["content"] if kind == "chat" else out["choices"][0]["text"]
    assert text == "tok tok tok tok"  # D's answer, not P's one token
    assert "kv_transfer_params" not in out
    await settled(r)

    # both hold the prefix now (P prefilled it, D published the blocks it pulled)
    tokens = list((PREFIX + "one").encode()) if kind == "completions" else None
    if tokens is not None:
        await wait_for(lambda: r.matched(tokens, "d0") == BLOCKS, 10, "D's BlockStored")
        await wait_for(lambda: r.matched(tokens, "p0") == BLOCKS, 10, "P's BlockStored")
        # a follow-up sharing the prefix: D reports P's real hit as its cached tokens
        again = await post(client, r, completion(PREFIX + "two"))
        assert again.status_code == 200, again.text
        assert again.headers["x-kvrouter-pd"] == "remote"
        hit = p.issued[-1]["remote_prefill_cached_tokens"]
        assert hit == BLOCKS * 16
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
        await settled(r)
    text = (await client.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_pd_decisions_total", decision="remote") >= 1
    assert metric(text, "kvrouter_pd_leg_seconds_count", leg="prefill") >= 1
    assert metric(text, "kvrouter_pd_leg_seconds_count", leg="decode") >= 1


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_nixl_streamed_decode_leg(pd, router, client, kind):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    body = completion(**opts) if kind == "completions" else chat(**opts)
    status, h, raw = await stream(client, r, body)
    assert status == 200, raw
    assert h["x-kvrouter-worker"] == "d0"
    assert h["x-kvrouter-pd"] == "remote"
    assert h["x-kvrouter-prefill-worker"] == "p0"
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and len(events) == 4 + 2  # D's four chunks, usage, DONE
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P's hit
    prefill_leg_ok(p.seen[0].body, body)
    assert d.seen[0].body == {**body, "kv_transfer_params": p.issued[0]}
    assert len(d.seen) == 1
    await settled(r)


async def test_n_above_one_is_one_leg_on_d_byte_for_byte(pd, router, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    raw = b'{"prompt":  "' + (PREFIX + "one").encode() + b'", "n": 2,"max_tokens":4 }'
    resp = await post(client, r, raw)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-worker"] == "d0"
    assert resp.headers["x-kvrouter-pd"] == "local"
    assert "x-kvrouter-prefill-worker" not in resp.headers
    assert p.seen == []
    assert [s.raw for s in d.seen] == [raw]
    await settled(r)


@pytest.mark.parametrize(
    "field, value",
    [
        ("kv_transfer_params", {"do_remote_prefill": True, "remote_engine_id": "x"}),
        ("bootstrap_host", "10.0.0.1"),
        ("bootstrap_port", 8998),
        ("bootstrap_room", 7),
    ],
)
async def test_a_client_never_steers_a_transfer(pd, workers, router, client, field, value):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    for body in (completion(**{field: value}), chat(**{field: value})):
        resp = await post(client, r, body)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == field, err
    assert p.seen == [] and d.seen == []
    await settled(r)
    # in every fleet, PD or not
    a = await workers("a")
    plain = await router([a])
    resp = await post(client, plain, completion(**{field: value}))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field
    assert a.requests == []
    assert "x-kvrouter-pd" not in resp.headers
    await settled(plain)


async def prefixed(r: Any, worker: Any, prompt: str = PREFIX + "one") -> None:
    """``worker`` announces the prompt's blocks, and the router's index has them."""
    tokens = list(prompt.encode())
    worker.store(tokens)
    await wait_for(lambda: r.matched(tokens, worker.worker_id) == BLOCKS, 10, "the events")


@pytest.mark.parametrize("fault", ["500", "reset"])
async def test_prefill_error_retries_another_prefill_once(pd, router, client, fault):
    bad = await pd.nixl_prefill("p-bad")
    good = await pd.nixl_prefill("p-good")
    d = await pd.nixl_decode("d0")
    r = await router([bad, good, d], pd=ALWAYS)
    await prefixed(r, bad)  # the first choice
    bad.set_fault(fault)
    body = completion()
    resp = await post(client, r, body)
    assert resp.status_code == 200, resp.text
    assert [s.outcome for s in bad.seen] == [f"fault:{fault}"]
    assert [s.outcome for s in good.seen] == ["prefill"]
    assert resp.headers["x-kvrouter-prefill-worker"] == "p-good"
    assert resp.headers["x-kvrouter-worker"] == "d0"
    assert d.seen[0].body == {**body, "kv_transfer_params": good.issued[0]}
    assert len(d.seen) == 1
    await settled(r)


@pytest.mark.parametrize("fault", ["500", "reset"])
async def test_prefill_errors_twice_then_local_on_d(pd, router, client, fault):
    p0 = await pd.nixl_prefill("p0")
    p1 = await pd.nixl_prefill("p1")
    p2 = await pd.nixl_prefill("p2")
    d = await pd.nixl_decode("d0")
    r = await router([p0, p1, p2, d], pd={**ALWAYS, "prefill_retries": 1})
    for p in (p0, p1, p2):
        p.set_fault(fault)
    body = completion()
    resp = await post(client, r, body)
    assert resp.status_code == 200, resp.text
    assert len(p0.seen) + len(p1.seen) + len(p2.seen) == 2  # one P, then another once
    assert resp.headers["x-kvrouter-worker"] == "d0"
    assert resp.headers["x-kvrouter-pd-fallback"] == "prefill_error"
    # local on D: the client's body as it was, no params
    assert [s.body for s in d.seen] == [body] and d.seen[0].outcome == "served"
    assert resp.json()["choices"][0]["text"] == "tok tok tok tok"
    await settled(r)
    text = (await client.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_pd_fallbacks_total", cause="prefill_error") == 1


async def test_prefill_4xx_goes_to_the_client_and_d_never_sees_it(pd, router, client):
    p0 = await pd.nixl_prefill("p0")
    p1 = await pd.nixl_prefill("p1")
    d = await pd.nixl_decode("d0")
    r = await router([p0, p1, d], pd=ALWAYS)
    p0.set_fault("400")
    p1.set_fault("400")
    resp = await post(client, r, completion())
    assert resp.status_code == 400
    assert "injected bad request" in resp.json()["error"]["message"]
    assert len(p0.seen) + len(p1.seen) == 1  # a 4xx is the answer: no other P
    assert d.seen == []
    await settled(r)


async def test_prefill_without_params_is_local_on_d(pd, router, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    p.set_fault("no_params")
    body = chat()
    resp = await post(client, r, body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-pd-fallback"] == "prefill_no_params"
    assert resp.headers["x-kvrouter-worker"] == "d0"
    assert len(p.seen) == 1
    assert [s.body for s in d.seen] == [body]
    assert resp.json()["choices"][0]["message"]["content"] == "tok tok tok tok"
    await settled(r)
    text = (await client.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_pd_fallbacks_total", cause="prefill_no_params") == 1


async def test_prefill_past_its_deadline_is_local_on_d(pd, router, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd={**ALWAYS, "prefill_timeout_s": 0.5})
    p.set_fault("hang")
    body = completion(stream=True)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    status, h, raw = await stream(client, r, body)
    assert status == 200, raw
    assert h["x-kvrouter-pd-fallback"] == "prefill_timeout"
    assert h["x-kvrouter-worker"] == "d0"
    events = sse_events(raw)
    assert loop.time() - t0 < 10
    assert events[-1] == "[DONE]"
    assert [s.body for s in d.seen] == [body]
    # the router gave up on the prefill leg: P saw it go away
    await wait_for(lambda: p.cancelled == 1, 10, "the prefill leg closed")
    await settled(r)


async def test_kv_load_failure_sends_the_decode_leg_again_without_params(pd, router, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    d.kv_load_fail = True
    body = completion(stream=True)
    status, h, raw = await stream(client, r, body)
    assert status == 200, raw
    assert h["x-kvrouter-pd-fallback"] == "decode_kv_load"
    assert h["x-kvrouter-worker"] == "d0"
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and len(events) == 5
    # exactly two decode requests: with P's params (failed), then the body as it was
    assert [s.body for s in d.seen] == [{**body, "kv_transfer_params": p.issued[0]}, body]
    assert d.seen[0].outcome.startswith("kv_load_failed")
    assert d.seen[1].outcome == "served"
    await settled(r)
    text = (await client.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_pd_fallbacks_total", cause="decode_kv_load") == 1


async def test_a_decode_failing_twice_is_answered_never_sent_a_third_time(pd, router, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    d.set_fault("500")
    resp = await post(client, r, completion())
    assert resp.status_code == 500
    assert len(d.seen) == 2
    assert "kv_transfer_params" in d.seen[0].body
    assert "kv_transfer_params" not in d.seen[1].body
    assert len(p.seen) == 1
    await settled(r)


async def test_a_plain_fleet_has_no_pd_headers(workers, router, client):
    a = await workers("a")
    r = await router([a], pd=ALWAYS)
    resp = await post(client, r, completion())
    assert resp.status_code == 200
    assert not [k for k in resp.headers if k.startswith("x-kvrouter-pd")]
    assert "x-kvrouter-prefill-worker" not in resp.headers
    assert a.requests == [completion()]
    route = (await client.post(r.url + "/route", json={"prompt": PREFIX})).json()
    assert route.get("pd") is None
    await settled(r)


# ------------------------------------------------------------------ through the router: SGLang


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_legs_go_together_with_one_room(pd, router, client, stream):
    p = await pd.sglang_prefill("p0", bootstrap_timeout_s=5)
    d = await pd.sglang_decode("d0", waiting_timeout_s=5)
    r = await router([p, d], pd={"mode": "always", "protocol": "sglang"})
    body = completion(stream=stream)
    resp = await post(client, r, body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-worker"] == "d0"
    assert resp.headers["x-kvrouter-pd"] == "remote"
    assert resp.headers["x-kvrouter-prefill-worker"] == "p0"
    # each leg waited for the other: both arrived together, with the same room
    assert [s.outcome for s in p.seen] == ["prefill"]
    assert [s.outcome for s in d.seen] == ["served_remote"]
    pb, db = p.seen[0].body, d.seen[0].body
    room = db["bootstrap_room"]
    assert pb["bootstrap_room"] == room and isinstance(room, int) and 0 <= room < 2**63
    for b in (pb, db):
        assert b["bootstrap_host"] == "127.0.0.1" and b["bootstrap_port"] == p.bootstrap_port
    assert {k: v for k, v in db.items() if not k.startswith("bootstrap_")} == body
    if stream:
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1])
    else:
        assert resp.json()["choices"][0]["text"] == "tok tok tok tok"  # the decode answer
    await settled(r)


async def test_sglang_prefill_failing_cancels_the_decode_leg(pd, router, client):
    p = await pd.sglang_prefill("p0", bootstrap_timeout_s=60)
    d = await pd.sglang_decode("d0", waiting_timeout_s=60)  # only the router can end its wait
    r = await router([p, d], pd={"mode": "always", "protocol": "sglang", "prefill_retries": 0})
    p.set_fault("500")
    resp = await post(client, r, completion())  # bounded: never the decode's 60 s wait
    await wait_for(lambda: d.cancelled == 1, 10, "the decode leg cancelled")
    # the decode leg went away, then the request ran locally on D: the body as the client sent it
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-pd-fallback"] == "prefill_error"
    assert [s.outcome for s in d.seen] == ["cancelled", "served"]
    assert "bootstrap_room" in d.seen[0].body and d.seen[1].body == completion()
    assert [s.outcome for s in p.seen] == ["fault:500"]
    await settled(r)


async def test_sglang_decode_failing_cancels_the_prefill_leg(pd, router, client):
    p = await pd.sglang_prefill("p0", bootstrap_timeout_s=60)
    d = await pd.sglang_decode("d0", waiting_timeout_s=60)
    r = await router([p, d], pd={"mode": "always", "protocol": "sglang"})
    d.set_fault("500", times=1)
    resp = await post(client, r, completion())
    # the prefill leg waits for a handshake that never comes: the router must close it
    await wait_for(lambda: p.cancelled == 1, 10, "the prefill leg cancelled")
    assert [s.outcome for s in p.seen] == ["cancelled"]
    # D answered an error to the leg with the room: D once more, without it, and never again
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-pd-fallback"] == "decode_kv_load"
    assert [s.outcome for s in d.seen] == ["fault:500", "served"]
    assert d.seen[1].body == completion()
    await settled(r)


# ------------------------------------------------------------------ /route and the three doors


async def test_route_answers_the_pair_the_decision_and_the_legs(pd, router, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    ans = (await client.post(r.url + "/route", json={"prompt": PREFIX + "one"})).json()
    assert ans["worker_id"] == "d0" and ans["url"] == d.url
    got = ans["pd"]
    assert got["decision"] == "remote" and got["reason"] and got["protocol"] == "nixl"
    assert got["prefill"]["worker_id"] == "p0" and got["prefill"]["url"] == p.url
    assert got["prefill"]["dp_rank"] == 0 and got["prefill"]["matched_blocks"] == 0
    pre, dec = got["legs"]
    assert pre["leg"] == "prefill" and pre["worker_id"] == "p0" and pre["url"] == p.url
    assert pre["set"]["max_tokens"] == 1 and pre["set"]["stream"] is False
    assert pre["set"]["kv_transfer_params"] == NIXL_PREFILL_REQUEST
    assert {"stream_options", "min_tokens"} <= set(pre["remove"])
    assert dec["leg"] == "decode" and dec["worker_id"] == "d0" and dec["url"] == d.url
    assert dec["from_prefill"] == ["kv_transfer_params"]
    assert p.seen == [] and d.seen == []  # /route only answers

    never = await router([p, d], pd={"mode": "never"})
    ans = (await client.post(never.url + "/route", json={"prompt": PREFIX + "one"})).json()
    assert ans["worker_id"] == "d0"
    assert ans["pd"]["decision"] == "local" and ans["pd"]["prefill"] is None
    await settled(r)
    await settled(never)


def _epp_envoy() -> Any:
    """tests/integration/router/epp/epp_envoy.py (its directory is on sys.path only when the
    EPP tests' conftest was collected)."""
    pytest.importorskip("grpc", reason="the epp extra")
    if "epp_envoy" in sys.modules:
        return sys.modules["epp_envoy"]
    path = Path(__file__).parent / "epp" / "epp_envoy.py"
    spec = importlib.util.spec_from_file_location("epp_envoy", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["epp_envoy"] = mod
    spec.loader.exec_module(mod)
    return mod


PICK_HEADERS = (
    "x-kvrouter-worker",
    "x-kvrouter-matched-blocks",
    "x-kvrouter-pd",
    "x-kvrouter-pd-reason",
    "x-kvrouter-prefill-worker",
)


async def test_proxy_route_and_epp_give_the_same_pick_and_headers(pd, router, client):
    p_warm = await pd.nixl_prefill("p-warm")
    p_cold = await pd.nixl_prefill("p-cold")
    d_warm = await pd.nixl_decode("d-warm")
    d_cold = await pd.nixl_decode("d-cold")
    fleet = [p_warm, p_cold, d_warm, d_cold]
    r = await router(fleet, pd=ALWAYS, epp={"port": 0, "plaintext": True})  # (a plain client)
    # the whole prompt on the warm pair already: no request below can change a match
    await prefixed(r, p_warm)
    await prefixed(r, d_warm)
    body = completion()

    ans = (await client.post(r.url + "/route", json={"prompt": body["prompt"]})).json()
    route = {
        "x-kvrouter-worker": ans["worker_id"],
        "x-kvrouter-matched-blocks": str(ans["matched_blocks"]),
        "x-kvrouter-pd": ans["pd"]["decision"],
        "x-kvrouter-pd-reason": ans["pd"]["reason"],
    }
    pre = [leg for leg in ans["pd"]["legs"] if leg["leg"] == "prefill"]
    if pre:
        route["x-kvrouter-prefill-worker"] = pre[0]["worker_id"]
    assert route["x-kvrouter-worker"] == "d-warm"
    assert route.get("x-kvrouter-prefill-worker", "p-warm") == "p-warm"

    resp = await post(client, r, body)
    assert resp.status_code == 200, resp.text
    proxy = {k: resp.headers[k] for k in PICK_HEADERS if k in resp.headers}
    assert proxy == route
    await settled(r)

    envoy_mod = _epp_envoy()
    from router.edge.epp.messages import endpoint_of

    envoy = envoy_mod.Envoy(r.app.state.epp_port)
    try:
        raw = json.dumps(body).encode()
        pick = await asyncio.wait_for(envoy.pick("/v1/completions", raw), T)
        assert pick.endpoint == endpoint_of(d_warm.url)
        if route["x-kvrouter-pd"] == "remote":
            assert pick.set_headers["x-prefiller-host-port"] == host_port(p_warm.url)
        else:
            assert "x-prefiller-host-port" not in pick.set_headers
        status, _, echoes = await asyncio.wait_for(
            pick.forward(client, "/v1/completions", raw, {"content-type": "application/json"}),
            T,
        )
        assert status == 200
        mutation = echoes[0].response_headers.response.header_mutation.set_headers
        head = {h.header.key: h.header.raw_value.decode() for h in mutation}
        epp = {k: head[k] for k in PICK_HEADERS if k in head}
        assert epp == route
        # a client-sent x-prefiller-host-port never survives the pick
        forged = [("x-prefiller-host-port", "10.0.0.1:1")]
        pick2 = await asyncio.wait_for(envoy.pick("/v1/completions", raw, headers=forged), T)
        assert pick2.set_headers.get("x-prefiller-host-port") != "10.0.0.1:1"
        assert (
            "x-prefiller-host-port" in pick2.removed or "x-prefiller-host-port" in pick2.set_headers
        )
        await asyncio.wait_for(pick2.forward(client, "/v1/completions", raw, {}), T)
    finally:
        await envoy.aclose()
    await settled(r)


async def test_a_prefill_engine_that_restarted_is_a_new_epoch(pd, router, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    first = await post(client, r, completion(PREFIX + "one"))
    assert first.status_code == 200, first.text
    await settled(r)
    p.restart_engine()  # its KV is gone; the next answer carries a new engine id
    again = await post(client, r, completion("something else entirely, " * 8))
    assert again.status_code == 200 and again.headers["x-kvrouter-pd"] == "remote"
    text = (await client.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_pd_prefill_restarts_total") == 1  # (the first id is no restart)
    await settled(r)


async def test_shared_storage_legs_carry_no_params(pd, router, client):
    # vLLM's ExampleConnector: the prefill worker writes the KV where the decode worker finds
    # it by the prompt; the legs are nixl's, without kv_transfer_params
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd={"mode": "always", "protocol": "shared_storage"})
    raw = b'{"prompt": "' + (PREFIX + "one").encode() + b'", "max_tokens": 4, "stream": true}'
    resp = await post(client, r, raw)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-pd"] == "remote"
    assert resp.headers["x-kvrouter-prefill-worker"] == "p0"
    sent = json.loads(raw)
    assert p.seen[0].body == {**sent, "max_tokens": 1, "max_completion_tokens": 1, "stream": False}
    assert [s.raw for s in d.seen] == [raw]  # the client's own bytes
    await settled(r)


async def test_an_accounted_route_holds_both_legs_until_released(pd, router, client):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([p, d], pd=ALWAYS)
    ans = await client.post(r.url + "/route", json={"prompt": PREFIX + "one", "account": True})
    assert ans.status_code == 200 and ans.headers["x-kvrouter-pd"] == "remote"
    load = r.state.placer.load
    lp, ld = load.get(("p0", 0)), load.get(("d0", 0))
    assert lp is not None and lp.inflight_prefill == BLOCKS  # P builds it
    assert ld is not None and ld.inflight_prefill == 0 and ld.requests == 1  # D holds it
    rid = ans.json()["route_id"]
    released = await client.post(f"{r.url}/route/{rid}/release")
    assert released.status_code == 200, released.text
    await settled(r)
