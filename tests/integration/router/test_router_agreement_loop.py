"""The closed loop over real sockets (issue 36): real fake workers publish real KV events and
report ``cached_tokens``; one of them goes wrong without a sequence gap — it reuses nothing its
events claim (prefix caching off, a different hash seed), its stores never reach the stream
(silent loss), or its events store under keys the router never computes (another hash seed),
so that the router sends it only new prefixes and its answers alone say nothing. The router names that worker and the likely cause within 50 of its requests
(``GET /workers``, ``/metrics``), scores it from what it sent it (and, for lost stores, from
what its events held, which was true), leaves the others on their events, and takes it back to
its events, from a fresh replay, once its reports agree again."""

from __future__ import annotations

from typing import Any

import httpx

from tests.waiting import wait_for

BS = 16
LOOP = {"hold_s": 0.0, "min_requests": 8, "window": 32}


def text(tag: str, blocks: int) -> str:
    return (tag * (blocks * BS))[: blocks * BS]


async def complete(http: httpx.AsyncClient, r: Any, prompt: str, worker: str) -> int:
    """Send ``prompt`` to ``worker`` (the admin's pin) through the proxy; its cached tokens."""
    resp = await http.post(
        r.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4},
        headers={"x-kvrouter-worker": worker},
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-worker"] == worker
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def listed(http: httpx.AsyncClient, r: Any) -> dict[str, dict[str, Any]]:
    resp = await http.get(r.url + "/workers")
    assert resp.status_code == 200, resp.text
    return {w["id"]: w for w in resp.json()["workers"]}


async def metric(http: httpx.AsyncClient, r: Any, line: str) -> bool:
    return line in (await http.get(r.url + "/metrics")).text


async def test_a_worker_reusing_nothing_its_events_claim_is_named_switched_and_back(
    workers, router, http
) -> None:
    a, b, c = await workers("a"), await workers("b"), await workers("c")
    a.reports_cached = False  # its events store every prompt; it reports reusing none
    r = await router([a, b, c], agreement=LOOP)
    sent = 0
    for i in range(25):  # each prompt twice: stored by the first, claimed for the second
        prompt = text(chr(ord("A") + i), 6) + "|tail"
        for w in ("a", "b"):
            await complete(http, r, prompt, w)
        await wait_for(lambda p=prompt: r.matched(list(p.encode()), "a") == 6, 5, "a's events")
        await complete(http, r, prompt, "a")
        assert await complete(http, r, prompt, "b") == 6 * BS  # b agrees throughout
        sent += 2
        if (await listed(http, r))["a"]["source"] == "approximate":
            break
    assert sent <= 50, "a was not named within 50 of its requests"
    ws = await listed(http, r)
    ag = ws["a"]["agreement"]
    assert (ag["scoring"], ag["kind"], ag["agrees"]) == ("approximate", "index_ahead", False)
    assert "reuses nothing" in ag["likely"]
    for other in ("b", "c"):
        assert ws[other]["source"] == "events" and ws[other]["agreement"]["scoring"] == "events"
    assert ws["b"]["agreement"]["agrees"] and ws["b"]["agreement"]["requests"] > 0
    line = 'kvrouter_agreement_disagreements_total{reason="index_ahead",worker="a"} 1.0'
    assert await metric(http, r, line)
    # its events are set aside: the index holds only what the router sends it from now on
    await wait_for(lambda: r.matched(list((text("A", 6) + "|tail").encode()), "a") == 0, 5)

    a.reports_cached = True  # fixed: its reports agree with what the router sends it
    replays = len(a.replay_requests)
    for i in range(60):
        prompt = text(chr(ord("a") + i % 26), 5) + f"|back {i}"
        await complete(http, r, prompt, "a")
        await wait_for(lambda p=prompt: r.matched(list(p.encode()), "a") == 5, 5, "a's tree")
        assert await complete(http, r, prompt, "a") == 5 * BS
        if (await listed(http, r))["a"]["source"] == "events":
            break
    ws = await listed(http, r)
    assert ws["a"]["source"] == "events" and ws["a"]["agreement"]["scoring"] == "events"
    # back from a fresh stream: a replay of what its publisher holds rebuilds its tree
    await wait_for(lambda: len(a.replay_requests) > replays, 5, "a's fresh replay")
    await wait_for(lambda: r.matched(list((text("B", 6) + "|tail").encode()), "a") == 6, 5)
    assert await metric(
        http, r, 'kvrouter_agreement_disagreeing{reason="index_ahead",worker="a"} 0.0'
    )


async def test_a_worker_whose_stores_are_silently_lost_is_named_and_scored_from_its_tree(
    workers, router, http
) -> None:
    a, b = await workers("a"), await workers("b")
    r = await router([a, b], agreement=LOOP)
    # what its events did say before the loss was true: it stays through the turn
    before = text("Q", 5) + "|before"
    a.store(list(before.encode()))
    await wait_for(lambda: r.matched(list(before.encode()), "a") == 5, 5, "a's events")
    a.silent_events = True  # what it stores never reaches the stream, and no seq is skipped
    for i in range(50):
        prompt = text(chr(ord("A") + i % 26), 6) + f"|{i}"
        a.store(list(prompt.encode()))  # it holds the prefix (another router sent it, say)
        assert await complete(http, r, prompt, "a") == 6 * BS
        if (await listed(http, r))["a"]["source"] == "approximate":
            break
    ws = await listed(http, r)
    ag = ws["a"]["agreement"]
    assert (ag["scoring"], ag["kind"]) == ("approximate", "worker_ahead")
    assert "never matched" in ag["likely"]
    assert ws["b"]["source"] == "events" and ws["b"]["agreement"]["scoring"] == "events"
    # scored from what the router sent it and what its events held when it turned (a worker
    # ahead of its events lost stores: what they say is true), both matched there now
    prompt = text("z", 4) + "|sent"
    await complete(http, r, prompt, "a")
    await wait_for(lambda: r.matched(list(prompt.encode()), "a") == 4, 5, "a's approximate tree")
    assert r.matched(list(before.encode()), "a") == 5


async def test_a_worker_whose_events_never_match_is_named_though_it_only_gets_new_prefixes(
    workers, router, http
) -> None:
    a, b = await workers("a"), await workers("b")
    a.events_salt = 1 << 20  # another hash seed: it announces every store, under other keys
    r = await router([a, b], agreement=LOOP)
    named = 0
    for i in range(50):  # every prompt new: nothing predicted, nothing reused, on either
        prompt = text(chr(ord("A") + i % 26), 4) + f"|new {i}"
        assert await complete(http, r, prompt, "a") == 0
        assert await complete(http, r, prompt + "|b", "b") == 0
        if (await listed(http, r))["a"]["source"] == "approximate":
            named = i + 1
            break
    assert 0 < named <= 50, "a was not named within 50 of its requests"
    ws = await listed(http, r)
    ag = ws["a"]["agreement"]
    assert (ag["scoring"], ag["kind"]) == ("approximate", "worker_ahead")
    assert "never showed" in ag["likely"] and "hash seed" in ag["likely"]
    # b's events show every prompt it was sent: it agrees, on its events
    assert ws["b"]["source"] == "events" and ws["b"]["agreement"]["agrees"]
