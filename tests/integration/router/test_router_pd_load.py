"""A remote pick's decode worker is taken from the pick on, over real sockets: while its prompt
is prefilled on a prefill worker, the router's load ledger holds the request on the decode worker
too, so the requests placed meanwhile see that worker loaded. Before, the decode leg's ticket
began only once the prefill answered, and requests placed during a prefill herded onto one decode
worker (live, conversation 5:3: 6.4 sequences a decode step against 4.5 under vllm-router).
Each request weighs there what a prefill beside it would cost it, from the body's ``max_tokens``
(router.placement.pd.stall_weight); its prefill leg weighs nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from router_fakeworker import wait_for

PROMPT = "You are a careful assistant. " * 20
ALWAYS = {"mode": "always", "protocol": "nixl"}


def held(r: Any) -> dict[str, int]:
    """Requests on each worker in the router's load ledger."""
    return {key[0]: ld.requests for key, ld in r.state.placer.load.items()}


def stalls(r: Any) -> dict[str, float]:
    """The stall weights on each worker in the router's load ledger."""
    return {key[0]: ld.stall for key, ld in r.state.placer.load.items()}


async def test_the_decode_worker_is_held_while_the_prompt_is_prefilled(pd, router):
    p = await pd.nixl_prefill("p0")
    d0, d1 = await pd.nixl_decode("d0"), await pd.nixl_decode("d1")
    r = await router([p, d0, d1], pd=ALWAYS)
    p.set_fault("hang")  # the prefill leg waits until the router lets it go
    async with httpx.AsyncClient(timeout=15.0, trust_env=False) as client:
        body = {"model": "fake-model", "prompt": PROMPT + "one", "max_tokens": 4}
        first = asyncio.create_task(client.post(r.url + "/v1/completions", json=body))
        await wait_for(lambda: len(p.seen) == 1, 10, "the first prefill leg at p0")
        now = held(r)
        assert now.get("p0") == 1
        assert now.get("d0", 0) + now.get("d1", 0) == 1  # its decode worker, before its KV
        first_d = "d0" if now.get("d0") else "d1"
        # 4 tokens: 200 / 3 stalls of the reference answer, at most 4; none for the prefill leg
        assert stalls(r) == {"p0": 0.0, first_d: 4.0}
        # a second request, placed now, sees it: it takes the other decode worker
        body2 = {**body, "prompt": "Another conversation entirely. " * 20, "max_tokens": 201}
        second = asyncio.create_task(client.post(r.url + "/v1/completions", json=body2))
        await wait_for(lambda: len(p.seen) == 2, 10, "the second prefill leg at p0")
        assert held(r) == {"p0": 2, "d0": 1, "d1": 1}
        other = "d1" if first_d == "d0" else "d0"
        assert stalls(r) == {"p0": 0.0, first_d: 4.0, other: 1.0}
        # the client leaves during the prefill: both legs end, nothing reached the decode worker
        first.cancel()
        second.cancel()
        for t in (first, second):
            with pytest.raises(asyncio.CancelledError):
                await t
        await wait_for(lambda: not held(r), 10, "the load ledger empty")
        assert d0.seen == [] and d1.seen == []
