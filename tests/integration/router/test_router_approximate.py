"""Workers without KV events (issue 36): they join (``events_endpoint: none``, ``POST /workers``
without events, a worker whose ``/kv_event_sources`` is missing), the router keeps an approximate
tree of what it sent there, a repeated prefix goes back to the worker that holds it (its own
``cached_tokens`` say it was a hit), the tree forgets its least recently sent prefixes at the
worker's reported KV capacity, a mixed fleet routes each kind on its own source, and ``/route``,
``GET /workers`` and ``/metrics`` name the source. Real fake workers over real sockets."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import httpx
from router_fakeworker import FakeWorker
from test_router_cli import LINE, _spawn

from tests.waiting import wait_for

BS = 16  # the router's default block size: one byte token a character


def text(tag: str, blocks: int) -> str:
    return (tag * (blocks * BS))[: blocks * BS]


def no_events(w: FakeWorker, **extra: Any) -> dict[str, Any]:
    return w.spec(events_endpoint="none", replay_endpoint=None, **extra)


# (r: conftest.RouterHandle; a conftest is no module to import from: two share the name)
async def complete(http: httpx.AsyncClient, r: Any, prompt: str) -> tuple[str, int]:
    """The worker the proxy sent ``prompt`` to and the cached tokens that worker reported."""
    resp = await http.post(r.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return resp.headers["x-kvrouter-worker"], cached


async def route(http: httpx.AsyncClient, r: Any, prompt: str) -> dict[str, Any]:
    """``/route``'s candidates by worker id."""
    resp = await http.post(r.url + "/route", json={"prompt": prompt})
    assert resp.status_code == 200, resp.text
    return {c["worker_id"]: c for c in resp.json()["candidates"]}


async def test_a_fleet_without_events_sends_a_repeated_prefix_back_to_its_holder(
    workers, router, http
) -> None:
    a, b = await workers("a"), await workers("b")
    r = await router(workers=[no_events(a), no_events(b)])
    shared = text("s", 6)
    first, cached = await complete(http, r, shared + "|one")
    assert cached == 0
    holder = {"a": a, "b": b}[first]
    # the tree holds what was sent (written by the subscriber task: wait for it)
    await wait_for(lambda: r.matched(list(shared.encode()), first) == 6, 5, "the sent blocks")
    for i in range(4):
        again, cached = await complete(http, r, shared + f"|again {i}")
        assert again == first
        assert cached == 6 * BS  # the worker's own cache says: a hit
    assert len(holder.requests) == 5
    cands = await route(http, r, shared + "|route")
    assert cands[first]["source"] == cands[next(iter(set(cands) - {first}))]["source"]
    assert cands[first]["source"] == "approximate"
    assert cands[first]["matched_by_tier"]["GPU"] == 6
    listed = (await http.get(r.url + "/workers")).json()["workers"]
    assert [(w["id"], w["source"], w["ranks"][0]["source"]) for w in listed] == [
        ("a", "approximate", "approximate"),
        ("b", "approximate", "approximate"),
    ]
    assert all(w["ready"] and w["events_stale"] is False for w in listed)
    metrics = (await http.get(r.url + "/metrics")).text
    assert 'kvrouter_index_source{dp_rank="0",source="approximate",worker="a"} 1.0' in metrics


async def test_the_tree_forgets_the_least_recently_sent_prefix_at_the_workers_capacity(
    workers, router, http
) -> None:
    w = await workers("small", kv_capacity=4)  # /metrics: 4 GPU blocks
    r = await router(workers=[no_events(w)])
    index = r.state.index
    await wait_for(lambda: index.rank_cap(("small", 0)) == (4, "capacity"), 10, "its capacity")
    old, new = text("o", 2), text("n", 4)
    await complete(http, r, old)
    await wait_for(lambda: r.matched(list(old.encode()), "small") == 2, 5, "the old prefix")
    await complete(http, r, new)
    await wait_for(lambda: r.matched(list(new.encode()), "small") == 4, 5, "the new prefix")
    cands = await route(http, r, old)
    # forgotten by the tree (2 + 4 blocks for 4); only the short-lived prediction remains
    assert cands["small"]["matched_by_tier"]["GPU"] == 0
    assert index.worker_stats(("small", 0)).forgotten_entries == 2
    metrics = (await http.get(r.url + "/metrics")).text
    assert (
        'kvrouter_index_evicted_entries_total{dp_rank="0",reason="approximate",worker="small"} 2.0'
        in metrics
    )


async def test_a_mixed_fleet_scores_each_worker_on_its_own_source(workers, router, http) -> None:
    ev, ap = await workers("ev", publish_on_request=False), await workers("ap")
    r = await router(workers=[ev.spec(), no_events(ap)])
    held = text("e", 4)
    ev.store(list(held.encode()))  # the event-fed worker announces a prefix by its events
    await wait_for(lambda: r.matched(list(held.encode()), "ev") == 4, 5, "the stored event")
    cands = await route(http, r, held + "|x")
    assert (cands["ev"]["source"], cands["ap"]["source"]) == ("events", "approximate")
    assert (cands["ev"]["matched_by_tier"]["GPU"], cands["ap"]["matched_blocks"]) == (4, 0)
    assert (await complete(http, r, held + "|x"))[0] == "ev"
    # a new prefix the approximate worker took goes back there; the one of events stays put
    sent_to_ap = None
    for i in range(16):
        prompt = text(chr(ord("a") + i), 4)
        if (await complete(http, r, prompt))[0] == "ap":
            sent_to_ap = prompt
            break
    assert sent_to_ap is not None, "no new prefix was placed on the approximate worker"
    await wait_for(lambda: r.matched(list(sent_to_ap.encode()), "ap") == 4, 5, "the sent blocks")
    assert await complete(http, r, sent_to_ap + "|y") == ("ap", 4 * BS)
    assert (await complete(http, r, held + "|z"))[0] == "ev"


async def test_workers_registered_without_events_join_approximate(workers, router, http) -> None:
    ev, late, bare = await workers("ev"), await workers("late"), await workers("bare")
    r = await router([ev])
    resp = await http.post(
        r.url + "/workers", json={"id": "late", "url": late.url, "events_endpoint": "none"}
    )
    assert resp.status_code == 201, resp.text
    assert resp.json()["source"] == "approximate" and resp.json()["ready"] is True
    # no events_endpoint, and the worker has no GET /kv_event_sources (404): it publishes
    # none, so it joins approximate rather than not at all
    resp = await http.post(r.url + "/workers", json={"id": "bare", "url": bare.url})
    assert resp.status_code == 201, resp.text
    assert (resp.json()["events_endpoint"], resp.json()["source"]) == ("none", "approximate")
    # a replay endpoint without events is a contradiction, named
    resp = await http.post(
        r.url + "/workers",
        json={
            "id": "x",
            "url": bare.url,
            "events_endpoint": "none",
            "replay_endpoint": "tcp://h:1",
        },
    )
    assert resp.status_code == 400 and "replay_endpoint" in resp.text
    cands = await route(http, r, text("q", 2))
    assert {k: c["source"] for k, c in cands.items()} == {
        "ev": "events",
        "late": "approximate",
        "bare": "approximate",
    }


async def test_kvrouter_serve_with_only_workers_without_events_routes_by_prefix(
    workers, http
) -> None:
    """The peers' approximate mode, as a real ``kvrouter serve`` process: no worker has
    events, and a repeated prefix still goes back to the worker that served it."""
    a, b = await workers("a"), await workers("b")
    specs = [f"id={w.worker_id},url={w.url},events=none,kv_blocks=1000" for w in (a, b)]
    args = [x for s in specs for x in ("--worker", s)]
    proc = await _spawn("serve", "--port", "0", "--admin-key", "k", *args)
    try:
        assert proc.stdout is not None
        m = LINE.search(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert m, "no listening line"
        url = m.group(1).decode()
        shared = text("p", 5)
        first = None
        for i in range(4):
            resp = await http.post(url + "/v1/completions", json={"prompt": shared + f"|{i}"})
            assert resp.status_code == 200, resp.text
            first = first or resp.headers["x-kvrouter-worker"]
            assert resp.headers["x-kvrouter-worker"] == first
        holder = {"a": a, "b": b}[first]
        assert len(holder.requests) == 4
        # the last three hit the holder's own cache (its usage says so)
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BS
        auth = {"Authorization": "Bearer k"}
        listed = (await http.get(url + "/workers", headers=auth)).json()["workers"]
        assert {(w["source"], w["kv_blocks"]) for w in listed} == {("approximate", 1000)}
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 30)
