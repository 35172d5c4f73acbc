"""The engine's OpenAI server on a real uvicorn socket: responses, streaming, stop strings, errors,
client disconnects, metrics, cache reset and the per-tier debug listing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from engine_helpers import Collector, serve, wait_for

from engine.config import EngineConfig, ServerSettings
from engine.server import create_app
from engine.tokenizer import render_chat
from indexer.events import CANONICAL_TIERS, AllBlocksCleared, BlockStored

MODEL = "kvrouter-sim"
LONG = "The quick brown fox jumps over the lazy dog while the engine caches blocks. " * 2


def _settings(tmp: Path | None = None, **engine: Any) -> ServerSettings:
    engine.setdefault("speedup", 100.0)
    if tmp is not None:
        engine.setdefault("num_cpu_blocks", 16)
        engine.setdefault("disk_dir", str(tmp / "disk"))
    return ServerSettings(
        engine=EngineConfig(**engine), events="tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0"
    )


@pytest.fixture
async def url(tmp_path: Path) -> AsyncIterator[str]:
    async with serve(create_app(_settings(tmp_path))) as u:
        yield u


async def test_chat_stream_matches_non_stream_and_reports_usage(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": LONG}]
    full = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    text = full.choices[0].message.content
    assert text and len(text) == 12 and full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.prompt_tokens == len(render_chat(messages))
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    details = chunks[-1].usage.prompt_tokens_details
    assert (
        details is not None and details.cached_tokens == (full.usage.prompt_tokens - 1) // 16 * 16
    )


async def test_completion_stop_string_cuts_the_text(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        body = {"prompt": LONG, "max_tokens": 20, "temperature": 0}
        text = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        stop = text[5:7]
        cut = text[: text.index(stop)]
        r = (await c.post("/v1/completions", json={**body, "stop": [stop]})).json()
        assert r["choices"][0] == {
            "index": 0,
            "text": cut,
            "logprobs": None,
            "finish_reason": "stop",
        }
        async with c.stream(
            "POST", "/v1/completions", json={**body, "stop": stop, "stream": True}
        ) as s:
            lines = [json.loads(x[6:]) async for x in s.aiter_lines() if x.startswith("data: {")]
        assert "".join(x["choices"][0]["text"] for x in lines) == cut
        assert lines[-1]["choices"][0]["finish_reason"] == "stop"


async def test_errors_are_json_like_the_router(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        cases = [
            (await c.post("/v1/completions", content=b"{not json"), 400),
            (await c.post("/v1/completions", json={"prompt": 5}), 400),
            (await c.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404),
            (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6}), 400),
            (await c.post("/v1/completions", json={"prompt": "x", "n": 2}), 400),
            (await c.post("/v1/chat/completions", json={"messages": []}), 400),
            (await c.post("/v1/chat/completions", json={"messages": [{"content": "x"}]}), 400),
            (await c.get("/nowhere"), 404),
        ]
    for r, status in cases:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type"} and err["message"]
    assert "maximum context length" in cases[3][0].json()["error"]["message"]


async def test_a_head_sent_at_once_comes_before_the_engine_has_looked_at_the_request() -> None:
    """``--stream-head at-once`` answers as vLLM does: a streamed request's head goes
    before the prefill, so what the engine refuses at admission is an SSE error after a 200."""
    body = {"prompt": "x", "max_tokens": 10**6, "stream": True}  # over the context length
    for head, status in (("first-token", 400), ("at-once", 200)):
        settings = ServerSettings(
            engine=EngineConfig(speedup=100.0), events=None, replay=None, stream_head=head
        )
        async with serve(create_app(settings)) as u, httpx.AsyncClient(base_url=u) as c:
            r = await c.post("/v1/completions", json=body, timeout=30)
            assert r.status_code == status, r.text
            if head == "at-once":
                events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert "maximum context length" in json.loads(events[0])["error"]["message"]
            good = {"prompt": LONG, "max_tokens": 4, "stream": True}
            r = await c.post("/v1/completions", json=good, timeout=30)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            assert r.text.count('"text"') >= 1


async def test_client_disconnect_aborts_the_sequence(tmp_path: Path) -> None:
    settings = _settings(speedup=1.0)  # ~8 ms per decode step: 2000 tokens take ~16 s
    async with serve(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:

        async def running() -> float:
            text = (await c.get("/metrics")).text
            line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running"))
            return float(line.split()[-1])

        body = {"prompt": "hello", "max_tokens": 2000, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    break
        # the response was closed after the first chunk: the engine must drop the sequence
        done = asyncio.Event()

        async def poll() -> None:
            while await running() != 0:
                await asyncio.sleep(0.02)
            done.set()

        await asyncio.wait_for(poll(), 10)
        assert done.is_set()

        # a non-streaming request whose client times out is aborted too
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
        await asyncio.wait_for(poll(), 10)


async def test_metrics_reset_and_debug_listing(tmp_path: Path) -> None:
    app = create_app(_settings(tmp_path))
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        st = app.state.kv
        col = Collector(st.events_endpoint)
        try:
            body = {"prompt": LONG, "max_tokens": 4}
            await c.post("/v1/completions", json=body)
            await c.post("/v1/completions", json=body)
            await wait_for(lambda: col.drain(5) or any(
                isinstance(e, BlockStored) and e.tier == "CPU_PINNED"
                for b in col.batches for e in b.events
            ), 20, "CPU_PINNED stores")  # fmt: skip
            listing = (await c.get("/debug/blocks")).json()
            assert listing["block_size"] == 16
            n_full = len(LONG) // 16
            assert len(listing["tiers"]["GPU"]) >= n_full
            assert set(listing["tiers"]) == set(CANONICAL_TIERS)

            metrics = (await c.get("/metrics")).text
            for name in (
                "vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total", "kvrouter_engine_blocks",
                "vllm:time_to_first_token_seconds_bucket",
                "vllm:request_time_per_output_token_seconds_bucket",
            ):  # fmt: skip
                assert f"\n{name}{{" in metrics, name
            # each of the two requests, 4 tokens, timed from its first output to its end
            tpot = next(
                x for x in metrics.splitlines()
                if x.startswith("vllm:request_time_per_output_token_seconds_count")
            )  # fmt: skip
            assert float(tpot.split()[-1]) == 2
            hits = next(
                x for x in metrics.splitlines() if x.startswith("vllm:prefix_cache_hits_total")
            )
            assert float(hits.split()[-1]) == (len(LONG) - 1) // 16 * 16
            assert 'tier="GPU"' in metrics

            assert (await c.post("/reset_prefix_cache")).json() == {"status": "ok"}
            assert all(v == [] for v in (await c.get("/debug/blocks")).json()["tiers"].values())
            await wait_for(
                lambda: col.drain(5) or any(
                    isinstance(e, AllBlocksCleared) for b in col.batches for e in b.events
                ), 20, "AllBlocksCleared",
            )  # fmt: skip
        finally:
            col.close()


async def test_models_tokenize_health(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await c.get("/health")).status_code == 200
        r = (await c.post("/tokenize", json={"prompt": "hé"})).json()
        assert r["tokens"] == list("hé".encode()) and r["count"] == 3
        msgs = [{"role": "user", "content": "Hi"}]
        r = (await c.post("/tokenize", json={"messages": msgs})).json()
        assert bytes(r["tokens"]).decode() == "<|user|>\nHi\n<|assistant|>\n"


async def test_sglang_worker_info_names_the_served_model(tmp_path: Path) -> None:
    # sglang-router reads these to register a worker under its model; model_path only for a
    # real local model directory (sglang-router would try to download a tokenizer for a label)
    settings = _settings(tmp_path, served_model_name="m1", num_gpu_blocks=128, block_size=32)
    async with serve(create_app(settings)) as u, httpx.AsyncClient(base_url=u, timeout=30) as c:
        info = (await c.get("/model_info")).json()
        server = (await c.get("/server_info")).json()
    assert info["served_model_name"] == "m1" and info["is_generation"] is True
    assert info["max_context_length"] == 128 * 32 and "model_path" not in info
    assert server["served_model_name"] == "m1" and server["page_size"] == 32
    assert server["max_total_num_tokens"] == 128 * 32 and "model_path" not in server
    assert server["kv_events_endpoint"].startswith("tcp://127.0.0.1:")

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    settings = _settings(model=str(model_dir))
    async with serve(create_app(settings)) as u, httpx.AsyncClient(base_url=u, timeout=30) as c:
        info = (await c.get("/model_info")).json()
    assert info["model_path"] == str(model_dir) and info["served_model_name"] == "model"
