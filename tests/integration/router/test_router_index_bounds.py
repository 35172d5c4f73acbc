"""A worker cannot hold more blocks than its KV capacity, so the router's index holds no more of
its entries than that capacity (learned from its ``/metrics``) times ``index.capacity_margin``:
a worker flooding distinct stores is held there, its least recently used entries going first,
while a bystander's events keep reaching ``/route`` at once (issue 21, item 5)."""

from __future__ import annotations

import logging
import random
import time

import pytest
from router_fakeworker import wait_for

CAPACITY = 64  # GPU blocks the flooding worker reports in vllm:cache_config_info
CAP = int(CAPACITY * 1.25)  # index.capacity_margin's default
FLOOD = ("flood", 0)
BS = 16


def toks(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(256) for _ in range(blocks * BS)]


async def poll(check, timeout: float, what: str) -> None:
    """Await ``check()`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def test_a_flooding_worker_is_held_to_its_kv_capacity(
    workers, router, http, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvrouter.index")
    flood = await workers("flood", kv_capacity=CAPACITY)
    quiet = await workers("quiet")
    r = await router([flood, quiet])
    gauge = (
        f'kvrouter_index_rank_max_entries{{dp_rank="0",source="capacity",worker="flood"}} {CAP}.0'
    )

    async def learned() -> bool:
        return gauge in (await http.get(r.url + "/metrics")).text

    await poll(learned, 10, "the flooding worker's capacity learned from its /metrics")

    def held() -> int:
        return sum(r.state.index.worker_stats(FLOOD).blocks_by_tier.values())

    async def visible(tokens: list[int]) -> bool:
        resp = await http.post(r.url + "/route", json={"token_ids": tokens})
        assert resp.status_code == 200, resp.text
        quiet_c = next(c for c in resp.json()["candidates"] if c["worker_id"] == "quiet")
        return bool(quiet_c["matched_blocks"] == len(tokens) // BS)

    rng = random.Random(21)
    hot = toks(rng, 4)
    flood.store(hot)
    await wait_for(lambda: r.matched(hot, "flood") == 4, 10, "the hot chain indexed")
    probes = []
    for _ in range(30):  # 30 bursts of 32 distinct blocks: 12 times the cap
        assert r.matched(hot, "flood") == 4  # matched (used) since fewer than CAP came after
        for _ in range(2):
            flood.store(toks(rng, 16))
        probe = toks(rng, 3)
        quiet.store(probe)
        probes.append(probe)
        await poll(lambda p=probe: visible(p), 5, "the bystander's store on /route")
        assert held() <= CAP
    sub = r.state.subscriber
    await wait_for(lambda: sub.stats()[FLOOD].last_seq == flood.seq - 1, 10, "the flood applied")
    assert held() <= CAP
    assert r.matched(hot, "flood") == 4
    assert all(r.matched(p, "quiet") == 3 for p in probes)  # the bystander lost nothing
    text = (await http.get(r.url + "/metrics")).text
    line = next(
        x
        for x in text.splitlines()
        if x.startswith("kvrouter_index_evicted_entries_total{")
        and 'reason="rank_cap"' in x
        and 'worker="flood"' in x
    )
    assert float(line.split()[-1]) >= 4 + 30 * 32 - CAP
    warned = [x for x in caplog.records if "flood" in x.getMessage()]
    assert len(warned) == 1, [x.getMessage() for x in warned]
