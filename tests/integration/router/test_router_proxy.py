"""The OpenAI proxy end to end: the official ``openai`` client → router → fake workers (real
uvicorn servers and real ZMQ event streams on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from router_fakeworker import wait_for

PREFIX = "You are a careful assistant. " * 20  # 580 bytes = 36 full blocks


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head == name or (
            head.startswith(name + "{") and all(p in head for p in want.split(",") if p)
        ):
            total += float(value)
    return total


# "direct": router.edge.server's config (h11, limits); "asgi": the app under uvicorn's defaults
SERVES = pytest.mark.parametrize("serve", ["direct", "asgi"])


@SERVES
async def test_openai_client_completions_and_chat_streaming_and_not(workers, router, http, serve):
    a = await workers("a")
    b = await workers("b")
    r = await router([a, b], plain_asgi=serve == "asgi")
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="test", max_retries=0)
    try:
        raw = await client.completions.with_raw_response.create(
            model="fake-model", prompt=PREFIX + "one", max_tokens=4
        )
        comp = raw.parse()
        assert comp.choices[0].text == "tok tok tok tok"
        first = raw.headers["x-kvrouter-worker"]
        assert first in ("a", "b")
        assert raw.headers["x-kvrouter-matched-blocks"] == "0"
        assert comp.usage is not None and comp.usage.prompt_tokens == len(PREFIX) + 3

        # the worker announced the prompt's blocks: the next request with the same prefix follows
        w = a if first == "a" else b
        await wait_for(lambda: r.matched(list(PREFIX.encode()), first) == 36, 10, "events")
        stream = await client.completions.create(
            model="fake-model",
            prompt=PREFIX + "two",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts = []
        usage = None
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        assert texts == ["tok0 ", "tok1 ", "tok2 ", "tok3 "]
        assert usage is not None and usage.prompt_tokens_details.cached_tokens == 36 * 16
        assert len(w.requests) == 2 and w.requests[1]["stream"] is True
        # the router forwarded the client's body untouched (stream_options only as asked)
        assert w.requests[1]["stream_options"] == {"include_usage": True}

        chat = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hello"}]
        )
        assert chat.choices[0].message.content == "tok tok tok tok"
        chunks = []
        async with await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hello"}], stream=True
        ) as s:
            async for c in s:
                chunks.append(c.choices[0].delta.content)
        assert chunks == ["tok0 ", "tok1 ", "tok2 ", "tok3 "]

        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]
        with_unknown = client.completions.create(model="nope", prompt="x", max_tokens=1)
        try:
            await with_unknown
            raise AssertionError("unknown model must fail")
        except openai.NotFoundError as e:
            assert "nope" in str(e)
    finally:
        await client.close()

    # predicted (36 blocks × 16) vs actual cached tokens reached the metrics
    text = (await http.get(r.url + "/metrics")).text
    assert metric(text, "kvrouter_cached_tokens_actual_total", worker=first) == 36 * 16
    assert metric(text, "kvrouter_cached_tokens_predicted_total", worker=first) >= 36 * 16
    assert metric(text, "kvrouter_proxied_requests_total") == 4
    assert metric(text, "kvrouter_inflight_requests") == 0
    assert r.state.placer.inflight == 0


@SERVES
async def test_client_disconnect_mid_stream_cancels_upstream(workers, router, serve):
    a = await workers("a", chunks=400, chunk_delay_s=0.02)
    r = await router([a], plain_asgi=serve == "asgi")
    async with (
        httpx.AsyncClient(timeout=30, trust_env=False) as c,
        c.stream("POST", r.url + "/v1/completions", json={"prompt": "hi", "stream": True}) as resp,
    ):
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                break
        assert a.running == 1
    # leaving the block closed the connection: the worker's generator must be cancelled
    await wait_for(lambda: a.cancelled == 1, 20, "upstream cancelled")
    assert a.completed == 0
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "router released the request")
    assert r.state.placer.load.get(("a", 0)) is None


@SERVES
async def test_client_disconnect_before_first_byte_cancels_upstream(workers, router, serve):
    a = await workers("a", first_token_delay_s=60)
    r = await router([a], plain_asgi=serve == "asgi")
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        task = asyncio.create_task(c.post(r.url + "/v1/completions", json={"prompt": "hi"}))
        await wait_for(lambda: a.running == 1, 20, "request reached the worker")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    await wait_for(lambda: a.cancelled == 1, 20, "upstream cancelled")
    await wait_for(lambda: r.state.placer.inflight == 0, 10, "router released the request")
