"""Why this worker (``scoring.explain``): the ``x-kvrouter-why`` header and the access line's
``why``, over real HTTP — a router on port 0 in front of fake workers publishing KV events over
ZMQ. The EPP's side is tests/integration/router/epp/test_epp_why.py."""

from __future__ import annotations

import json
import logging

from router_fakeworker import engine_hash, wait_for

from indexer.events import DEFAULT_TIER_WEIGHTS, BlockStored

PREFIX = "You are a careful assistant. " * 20  # 580 bytes = 36 full blocks
TOKENS = list(PREFIX.encode())


def parse_why(value: str) -> tuple[dict[str, str], dict[str, str]]:
    """``worker=b blocks=... cost=4.1; next=a cost=9.7 margin=5.6`` -> (chosen, runner-up)."""
    chosen, _, runner = value.partition("; ")
    return (
        dict(kv.split("=", 1) for kv in chosen.split()),
        dict(kv.split("=", 1) for kv in runner.split()),
    )


async def split_tiers(r, w) -> None:
    """``w`` holds the prompt's first 20 blocks on GPU and the next 16 in CPU memory."""
    w.store(TOKENS[:320])
    hashes = [engine_hash(TOKENS, (i + 1) * 16) for i in range(20, 36)]
    parent = engine_hash(TOKENS, 320)
    w.publish([BlockStored(hashes, parent, TOKENS[320:576], 16, medium="CPU")])
    await wait_for(lambda: r.matched(TOKENS, w.worker_id) == 36, 10, "b's events")


async def test_the_answer_and_the_access_line_say_why_the_worker(workers, router, http, caplog):
    caplog.set_level(logging.INFO, logger="kvrouter.access")
    a = await workers("a", publish_on_request=False)
    b = await workers("b", publish_on_request=False)
    r = await router([a, b], scoring={"explain": True})
    await split_tiers(r, b)

    body = {"model": "fake-model", "prompt": PREFIX + "x", "max_tokens": 2}
    resp = await http.post(r.url + "/v1/completions", json=body)
    assert resp.status_code == 200 and resp.headers["x-kvrouter-worker"] == "b"
    why = resp.headers["x-kvrouter-why"]
    chosen, runner = parse_why(why)
    assert chosen["worker"] == "b" and chosen["blocks"] == "GPU:20,CPU_PINNED:16"
    assert chosen["of"] == "36"
    credit = 20 + DEFAULT_TIER_WEIGHTS["CPU_PINNED"] * 16
    assert float(chosen["credit"]) == round(credit, 1)
    assert runner["next"] == "a"
    margin = float(runner["cost"]) - float(chosen["cost"])
    assert float(runner["margin"]) > 0 and abs(float(runner["margin"]) - margin) <= 0.11

    # the access line repeats it (a field of its own with log_format json)
    lines = [x for x in caplog.records if x.name == "kvrouter.access"]
    line = next(x for x in lines if x.access["path"] == "/v1/completions")  # type: ignore[attr-defined]
    assert line.access["why"] == why  # type: ignore[attr-defined]
    assert f'why="{why}"' in line.getMessage()

    # POST /route with the same body: the same explanation, its numbers the candidates' own
    resp = await http.post(r.url + "/route", json={"prompt": PREFIX + "x"})
    assert resp.status_code == 200
    chosen, runner = parse_why(resp.headers["x-kvrouter-why"])
    cands = {c["worker_id"]: c for c in resp.json()["candidates"]}
    assert chosen["worker"] == "b" and runner["next"] == "a"
    assert float(chosen["cost"]) == round(cands["b"]["cost"], 1)
    assert float(runner["cost"]) == round(cands["a"]["cost"], 1)


async def test_streamed_answers_say_why_and_a_lone_worker_has_no_runner_up(workers, router, http):
    a = await workers("a")
    r = await router([a], scoring={"explain": True})
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, "stream": True}
    async with http.stream("POST", r.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-kvrouter-why"].startswith("worker=a blocks=0 of=0 credit=0.0 ")
        assert ";" not in resp.headers["x-kvrouter-why"]  # nothing else could have taken it
        assert b"[DONE]" in b"".join([c async for c in resp.aiter_bytes()])


async def test_off_by_default(workers, router, http, caplog):
    caplog.set_level(logging.INFO, logger="kvrouter.access")
    a = await workers("a")
    r = await router([a])
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    resp = await http.post(r.url + "/v1/completions", json=body)
    assert resp.status_code == 200 and resp.headers["x-kvrouter-worker"] == "a"
    assert "x-kvrouter-why" not in resp.headers
    resp = await http.post(r.url + "/route", content=json.dumps({"prompt": "hi"}))
    assert resp.status_code == 200 and "x-kvrouter-why" not in resp.headers
    lines = [x for x in caplog.records if x.name == "kvrouter.access"]
    assert lines and all("why" not in x.access for x in lines)  # type: ignore[attr-defined]
