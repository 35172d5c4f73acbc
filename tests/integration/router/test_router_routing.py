"""Placement through real event streams: tiers, load, herding, pools, accounted routes."""

from __future__ import annotations

import asyncio
import random

import pytest
from router_fakeworker import wait_for

from router.settings import DEFAULT_CACHE_CREDIT, DEFAULT_OVERLAP_WEIGHT

BS = 16


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def cand(body: dict, worker: str) -> dict:
    return next(c for c in body["candidates"] if c["worker_id"] == worker)


async def route(http, r, **body) -> dict:
    resp = await http.post(r.url + "/route", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def until_matched(http, r, tokens, worker, tier, n) -> dict:
    """Poll /route until ``worker`` shows ``n`` blocks on ``tier`` (events are asynchronous)."""
    last: dict = {}

    async def probe() -> bool:
        nonlocal last
        last = await route(http, r, token_ids=tokens)
        return cand(last, worker)["matched_by_tier"].get(tier) == n

    deadline = asyncio.get_running_loop().time() + 20
    while not await probe():
        assert asyncio.get_running_loop().time() < deadline, f"events never applied: {last}"
        await asyncio.sleep(0.01)
    return last


OW, CC = DEFAULT_OVERLAP_WEIGHT, DEFAULT_CACHE_CREDIT
#: what a worker pays per block of the request it must prefill while another worker holds it
LACKED = OW * CC


def expected_cost(c: dict, n: int, best: float) -> float:
    """The cost formula (docs/architecture.md §5) by hand; ``best``: the largest credit."""
    w = {"GPU": 1.0, "CPU_PINNED": 0.8, "DISK": 0.5, "EXTERNAL": 0.3}
    credit = c["predicted_blocks"] + sum(w.get(t, 0.3) * m for t, m in c["matched_by_tier"].items())
    prefill = max(0.0, c["inflight_prefill_blocks"] - c["shared_prefill_blocks"])
    active = max(0, c["active_blocks"] - c["shared_active_blocks"])
    return OW * (prefill + n - credit + (CC - 1) * (best - credit)) + active


async def test_prefix_on_b_gpu_goes_to_b_and_proxy_follows(workers, router, http):
    a, b = await workers("a"), await workers("b")
    r = await router([a, b])
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # 360 bytes: 22 blocks
    tokens = list(prompt.encode())
    assert b.store(tokens) == 22
    body = await until_matched(http, r, tokens, "b", "GPU", 22)
    assert body["worker_id"] == "b" and body["request_blocks"] == 22
    assert cand(body, "b")["cost"] == 0.0 and cand(body, "a")["cost"] == 22 * LACKED
    assert body["matched_blocks"] == 22 and body["url"] == b.url
    assert body["cached_blocks"] == 22  # the deprecated name, still answered
    # /route is read-only: no load, no prediction was recorded
    assert r.state.placer.load.get(("b", 0)) is None and len(r.state.placer.predicted) == 0

    resp = await http.post(
        r.url + "/v1/completions", json={"prompt": prompt + "!", "model": "fake-model"}
    )
    assert resp.status_code == 200
    assert resp.headers["x-kvrouter-worker"] == "b"
    assert resp.headers["x-kvrouter-matched-blocks"] == "22"
    assert resp.headers["x-kvrouter-cached-blocks"] == "22"  # the deprecated name
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 22 * BS
    assert len(b.requests) == 1 and not a.requests
    assert (
        len(r.state.placer.predicted) == 0
    )  # b's events already announced every block: no prediction


async def test_disk_on_a_and_gpu_on_b_goes_to_b(workers, router, http):
    a, b = await workers("a"), await workers("b")
    r = await router([a, b])
    tokens = toks(1, 40 * BS)
    a.store(tokens, medium="DISK")
    b.store(tokens)
    await until_matched(http, r, tokens, "a", "DISK", 40)
    body = await until_matched(http, r, tokens, "b", "GPU", 40)
    assert body["worker_id"] == "b"
    ca, cb = cand(body, "a"), cand(body, "b")
    assert ca["matched_by_tier"] == {"GPU": 0, "CPU_PINNED": 0, "DISK": 40, "EXTERNAL": 0}
    assert ca["credited_blocks"] == pytest.approx(20.0)
    assert ca["cost"] == pytest.approx(20.0 * LACKED)  # the 20 credited blocks b has beyond a
    assert cb["cost"] == 0.0
    # unknown media are scored like EXTERNAL, never like GPU
    other = toks(2, 10 * BS)
    a.store(other, medium="TAPE")
    body = await until_matched(http, r, other, "a", "TAPE", 10)
    assert cand(body, "a")["credited_blocks"] == pytest.approx(3.0)


async def test_overloaded_a_loses_to_idle_b_by_cost(workers, router, http):
    a, b = await workers("a"), await workers("b")
    r = await router([a, b])
    prefix = toks(3, 8 * BS)
    a.store(prefix)
    body = await until_matched(http, r, prefix, "a", "GPU", 8)
    assert body["worker_id"] == "a"  # cached and idle: A

    # load A past what turning away from 8 cached blocks costs (8 · overlap_weight · cache_credit
    # = 1,024 blocks): an accounted placement of a 1,100-block prompt that only A caches
    big = toks(4, 1100 * BS)
    a.store(big)
    await until_matched(http, r, big, "a", "GPU", 1100)
    acc = await route(http, r, token_ids=big, account=True)
    assert acc["worker_id"] == "a" and acc["route_id"]

    body = await route(http, r, token_ids=prefix)
    ca, cb = cand(body, "a"), cand(body, "b")
    assert ca["matched_blocks"] == 8 and ca["active_blocks"] == 1101  # 1,100 blocks + 1 request
    assert ca["cost"] == pytest.approx(expected_cost(ca, 8, 8.0)) == pytest.approx(1101.0)
    assert cb["cost"] == pytest.approx(expected_cost(cb, 8, 8.0)) == pytest.approx(8 * LACKED)
    assert body["worker_id"] == "b"  # the cost decides, not the cache alone

    rel = await http.post(f"{r.url}/route/{acc['route_id']}/release")
    assert rel.status_code == 200
    assert (await http.post(f"{r.url}/route/{acc['route_id']}/release")).status_code == 404
    body = await route(http, r, token_ids=prefix)
    assert body["worker_id"] == "a" and cand(body, "a")["active_blocks"] == 0


async def test_herding_concurrent_shared_prefix_lands_on_few_workers(workers, router, http):
    ws = [await workers(f"w{i}", first_token_delay_s=0.3) for i in range(4)]
    r = await router(ws)
    shared = "".join(chr(ord("a") + i % 26) for i in range(2048))  # 128 blocks, new to everyone

    async def one(i: int):
        resp = await http.post(
            r.url + "/v1/completions", json={"prompt": shared + f"|{i:015d}", "max_tokens": 4}
        )
        assert resp.status_code == 200, resp.text
        return resp.headers["x-kvrouter-worker"], int(resp.headers["x-kvrouter-matched-blocks"])

    results = await asyncio.gather(*(one(i) for i in range(32)))
    used = {w for w, _ in results}
    assert len(used) <= 2, results
    # all but the first were placed while no event had arrived: on predicted blocks
    assert sum(1 for _, cached in results if cached >= 128) >= 31 - len(used)
    served = sum(len(w.requests) for w in ws)
    assert served == 32
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "all released")


async def test_herding_would_scatter_without_predictions(workers, router, http):
    ws = [await workers(f"w{i}", first_token_delay_s=0.3) for i in range(4)]
    r = await router(ws, scoring={"predicted_ttl_s": 0})
    shared = "".join(chr(ord("a") + i % 26) for i in range(2048))
    results = await asyncio.gather(
        *(
            http.post(r.url + "/v1/completions", json={"prompt": shared + f"|{i:015d}"})
            for i in range(8)
        )
    )
    used = {resp.headers["x-kvrouter-worker"] for resp in results}
    assert len(used) == 4  # the control: load alone spreads a new prefix over every worker


async def test_external_pool_credits_every_member(workers, router, http):
    a, b, c = await workers("a"), await workers("b"), await workers("c")
    r = await router(
        [],
        workers=[a.spec(pool="p1"), b.spec(pool="p1"), c.spec()],
    )
    tokens = toks(5, 10 * BS)
    a.store(tokens, medium="EXTERNAL")
    body = await until_matched(http, r, tokens, "b", "EXTERNAL", 10)
    assert cand(body, "a")["matched_by_tier"]["EXTERNAL"] == 10
    assert cand(body, "c")["matched_blocks"] == 0
    assert cand(body, "b")["credited_blocks"] == pytest.approx(3.0)


async def test_temperature_sampling_is_seeded_and_spreads(workers, router, http):
    ws = [await workers(f"w{i}") for i in range(3)]
    r = await router(ws, scoring={"temperature": 5.0, "seed": 7})
    picks = [(await route(http, r, token_ids=toks(6, 4 * BS)))["worker_id"] for _ in range(60)]
    assert len(set(picks)) == 3  # equal costs: sampling spreads; deterministic ties would not
    r2 = await router(ws, scoring={"temperature": 0.0})
    picks2 = {(await route(http, r2, token_ids=toks(6, 4 * BS)))["worker_id"] for _ in range(20)}
    assert len(picks2) == 1


async def test_cache_salt_in_the_body_reaches_the_hash(workers, router, http):
    """Blocks stored under a cache salt (vLLM: an extra key of the first block) match only
    /route requests carrying the same ``cache_salt``."""
    from indexer.events import BlockStored

    a = await workers("a")
    r = await router([a])
    tokens = toks(9, 4 * BS)
    a.publish(
        [BlockStored([901, 902, 903, 904], None, tokens, BS, extra_keys=[["t1"]] + [None] * 3)]
    )

    deadline = asyncio.get_running_loop().time() + 20
    while cand(await route(http, r, token_ids=tokens, cache_salt="t1"), "a")["matched_blocks"] < 4:
        assert asyncio.get_running_loop().time() < deadline, "salted blocks never matched"
        await asyncio.sleep(0.01)
    assert cand(await route(http, r, token_ids=tokens), "a")["matched_blocks"] == 0
    other = await route(http, r, token_ids=tokens, cache_salt="t2")
    assert cand(other, "a")["matched_blocks"] == 0


async def test_an_openai_body_posted_to_route_is_the_proxys_dry_run(workers, router, http):
    """docs/deploy.md: /route reads the OpenAI body as it is, changes nothing, and answers the
    worker the proxy then picks; a route_id comes only with "account": true."""
    a, b = await workers("a"), await workers("b")
    r = await router([a, b])
    body = {
        "model": "fake-model",
        "prompt": "why this worker? " * 16,
        "max_tokens": 4,
        "temperature": 0,
    }
    first = await http.post(r.url + "/v1/completions", json=body)
    assert first.status_code == 200, first.text
    cached_on = first.headers["x-kvrouter-worker"]

    async def dry() -> dict:
        return await route(http, r, **body)

    deadline = asyncio.get_running_loop().time() + 20
    while (ans := await dry())["matched_blocks"] < 16:  # its events reach the index
        assert asyncio.get_running_loop().time() < deadline, ans
        await asyncio.sleep(0.01)
    assert ans["worker_id"] == cached_on and "route_id" not in ans
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "the proxied request ended")
    for _ in range(2):  # nothing counted, however often it is asked
        assert all(c["active_blocks"] == 0 for c in (await dry())["candidates"])
    again = await http.post(r.url + "/v1/completions", json=body)
    assert again.headers["x-kvrouter-worker"] == ans["worker_id"]
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "the proxied request ended")
    accounted = await route(http, r, **body, account=True)
    assert accounted["worker_id"] == ans["worker_id"] and accounted["route_id"]
    assert cand(await dry(), ans["worker_id"])["active_blocks"] > 0  # this one is counted
