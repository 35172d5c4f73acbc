"""Several router replicas behind one address (the Kubernetes Service of
``deploy/kubernetes/base``): two router apps on real ports, each subscribed to the same real
workers' KV events, answer the same ``/route`` for the same state; and load placed through one
replica steers the other, through the workers' own scraped ``/metrics`` (``health.scrape_metrics``
+ ``scoring.running_weight``), with no protocol between the replicas."""

from __future__ import annotations

import asyncio
import contextlib
import random

from router_fakeworker import wait_for

BS = 16


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


async def route(http, r, tokens: list[int]) -> dict:
    resp = await http.post(r.url + "/route", json={"token_ids": tokens})
    assert resp.status_code == 200, resp.text
    return resp.json()


def decision(body: dict) -> tuple:
    """What a replica decided, without per-process details."""
    cands = sorted(
        (
            c["worker_id"],
            c["matched_blocks"],
            tuple(sorted(c["matched_by_tier"].items())),
            c["cost"],
        )
        for c in body["candidates"]
    )
    return body["worker_id"], body["matched_blocks"], tuple(cands)


async def test_two_replicas_answer_the_same_route_for_the_same_events(workers, router, http):
    a, b, c = await workers("a"), await workers("b"), await workers("c")
    one = await router([a, b, c])
    two = await router([a, b, c])
    shared = toks(1, 8 * BS)
    queries = [
        shared + toks(2, 4 * BS),  # the shared prefix: most cached on b (GPU)
        shared[: 3 * BS] + toks(3, 6 * BS),  # 3 blocks on a and on b: a tie, broken alike
        toks(4, 10 * BS),  # on c's CPU tier only
        toks(5, 5 * BS),  # cached nowhere: the tie-break decides, the same in both
        toks(6, 7),  # less than one block
    ]
    a.store(shared[: 3 * BS])
    b.store(shared + toks(2, 2 * BS))
    c.store(queries[2], medium="CPU")
    expect = {("a", 3), ("b", 10), ("c", 10)}

    def indexed(r) -> bool:
        got = set()
        for w, q in (("a", queries[1]), ("b", queries[0]), ("c", queries[2])):
            got.add((w, r.matched(q, w)))
        return got == expect

    await wait_for(lambda: indexed(one) and indexed(two), 20, "both replicas indexed the events")
    answers = []
    for q in queries:
        first, second = await route(http, one, q), await route(http, two, q)
        assert decision(first) == decision(second), (first, second)
        answers.append(first["worker_id"])
    assert answers[0] == "b" and answers[1] in ("a", "b") and answers[2] == "c", answers
    # and as the state changes, both follow it: a's GPU now holds the longest prefix
    a.store(queries[0])
    await wait_for(
        lambda: one.matched(queries[0], "a") == 12 and two.matched(queries[0], "a") == 12,
        20,
        "the new events on both",
    )
    first, second = await route(http, one, queries[0]), await route(http, two, queries[0])
    assert decision(first) == decision(second) and first["worker_id"] == "a"


async def test_load_placed_through_one_replica_steers_the_other(workers, router, http):
    """Replica ``one`` proxies requests that stay in flight on worker ``a``; replica ``two``
    never saw them, yet stops choosing ``a`` once its scrape of a's ``/metrics`` shows them."""
    a = await workers("a", first_token_delay_s=30.0)  # requests placed on a stay running
    b = await workers("b")
    # the 9 cached blocks credit 9 · 16 · 8 = 1,152 (default weights); 3 running · 500 outweigh it
    scoring = {"running_weight": 500.0}
    health = {"interval_s": 0.1, "timeout_s": 2.0, "scrape_metrics": True}
    one = await router([a, b], scoring=scoring, health=health)
    two = await router([a, b], scoring=scoring, health=health)
    prompt = "a shared system prompt, cached on a. " * 4
    tokens = list(prompt.encode())
    a.store(tokens)
    await wait_for(lambda: two.matched(tokens, "a") == len(tokens) // BS, 20, "indexed on two")
    assert (await route(http, two, tokens))["worker_id"] == "a"

    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 4}
    held = [
        asyncio.create_task(http.post(one.url + "/v1/completions", json=body)) for _ in range(3)
    ]
    try:
        await wait_for(lambda: a.running == 3, 20, "three requests running on a")

        def scraped_by(r) -> bool:
            st = r.state.registry.workers["a"].scraped
            return st is not None and st.running == 3

        await wait_for(lambda: scraped_by(two), 20, "replica two scraped a's running requests")
        answer = await route(http, two, tokens)
        assert answer["worker_id"] == "b", answer
        (cand_a,) = [c for c in answer["candidates"] if c["worker_id"] == "a"]
        assert cand_a["matched_blocks"] == len(tokens) // BS, "a still holds the prefix"
        assert two.state.placer.load.inflight("a") == 0, (
            "two learned the load only from a's metrics"
        )
        # one's own cost counts its requests' active blocks, and a's running ones only from its
        # own scrape: on a loaded machine that scrape can still be one from before the third
        await wait_for(lambda: scraped_by(one), 20, "replica one scraped a's running requests")
        assert (await route(http, one, tokens))["worker_id"] == "b"
    finally:
        for t in held:
            t.cancel()
        for t in held:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    await wait_for(lambda: a.running == 0, 20, "a's requests cancelled with their clients")
