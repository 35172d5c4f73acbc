"""A small but real inference worker for the router's tests (the server helpers it re-exports
are ``router_servers``'s).

``FakeWorker`` is a uvicorn app on 127.0.0.1 port 0 that answers ``/v1/completions`` and
``/v1/chat/completions`` (streaming SSE and not, with ``usage.prompt_tokens_details.cached_tokens``
from its own prefix cache), ``/v1/models``, ``/tokenize``, ``/metrics`` and ``/health``, and
publishes its KV events over a real ZMQ PUB socket (vLLM >= 0.24 wire format, through
``indexer.wire``'s encoder) with a ROUTER replay socket. Tokens are UTF-8 bytes, chat is rendered
like the bundled engine's default (``router.runtime.tokenize.render_byte_chat``).

It records what it saw: requests, the ones cancelled by a disconnect, the ones completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio
from router_servers import ServerHandle, wait_for
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from indexer.events import BlockStored, Event
from indexer.wire import (
    decode_replay_request,
    encode_message,
    encode_payload,
    encode_replay_end,
    encode_replay_reply,
)
from router.runtime.tokenize import render_byte_chat

__all__ = ["LOCAL", "FakeWorker", "ServerHandle", "engine_hash", "wait_for"]

LOCAL = "tcp://127.0.0.1"
_M63 = (1 << 63) - 1


def engine_hash(tokens: Sequence[int], upto: int) -> int:
    """The fake engine's opaque block key: any stable function of the prefix will do."""
    return hash(tuple(tokens[:upto])) & _M63


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class FakeWorker:
    def __init__(
        self,
        worker_id: str,
        ctx: zmq.asyncio.Context,
        *,
        block_size: int = 16,
        model: str = "fake-model",
        first_token_delay_s: float = 0.0,
        chunk_delay_s: float = 0.005,
        chunks: int = 4,
        publish_on_request: bool = True,
        replay_mode: str = "answer",
        tls: tuple[str, str] | None = None,
        kv_capacity: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        #: GPU KV blocks reported on /metrics (vLLM's ``vllm:cache_config_info``); None: not reported
        self.kv_capacity = kv_capacity
        #: (certificate, key) PEM files: the worker serves https
        self.tls = tls
        self.block_size = block_size
        self.model = model
        self.first_token_delay_s = first_token_delay_s
        self.chunk_delay_s = chunk_delay_s
        self.chunks = chunks
        self.publish_on_request = publish_on_request
        #: "answer" replies to replay requests; "hold" keeps them until ``release_replay()``
        self.replay_mode = replay_mode
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []
        self.cancelled = 0
        self.completed = 0
        self.running = 0
        self.cached: set[int] = set()  # engine hashes on GPU
        #: faults for the closed loop's tests: stores that never reach the stream (no gap in
        #: seq: silent loss), answers that report no cached tokens (prefix caching off), and
        #: stores announced under token ids offset by this (another hash seed: never matched)
        self.silent_events = False
        self.reports_cached = True
        self.events_salt = 0
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"{LOCAL}:*")
        self.events_endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"{LOCAL}:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_requests: list[int] = []
        self._held: list[tuple[bytes, int]] = []
        self._replay_task: asyncio.Task[None] | None = None
        self.http: ServerHandle | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> FakeWorker:
        self._replay_task = asyncio.create_task(self._serve_replay())
        tls = {} if self.tls is None else {"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]}
        self.http = await ServerHandle(self.app, **tls).start()
        return self

    @property
    def url(self) -> str:
        assert self.http is not None
        return self.http.url

    def spec(self, **extra: Any) -> dict[str, Any]:
        """A ``workers:`` entry for the router's settings."""
        d: dict[str, Any] = {
            "id": self.worker_id,
            "url": self.url,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
        }
        d.update(extra)
        return d

    async def stop_http(self) -> None:
        if self.http is not None:
            await self.http.stop()

    async def aclose(self) -> None:
        await self.stop_http()
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self.router.close(linger=0)
        self.pub.close(linger=0)

    # ------------------------------------------------------------- KV events

    def publish(self, events: Sequence[Event]) -> int:
        seq = self.seq
        self.seq += 1
        payload = encode_payload(events, ts=time.time(), dp_rank=0)
        self.buffer.append((seq, payload))
        self.pub.send_multipart(encode_message(b"", seq, payload))
        return seq

    def store(self, tokens: Sequence[int], *, medium: str | None = None) -> int:
        """Announce every full block of ``tokens`` (one chained BlockStored); returns blocks."""
        bs = self.block_size
        n = len(tokens) // bs
        if n == 0:
            return 0
        hashes = [engine_hash(tokens, (i + 1) * bs) for i in range(n)]
        if medium is None:
            self.cached.update(hashes)
        if self.silent_events:
            return n
        self.publish(
            [
                BlockStored(
                    block_hashes=list(hashes),
                    parent_block_hash=None,
                    token_ids=[t + self.events_salt for t in tokens[: n * bs]],
                    block_size=bs,
                    medium=medium,
                )
            ]
        )
        return n

    def cached_prefix_tokens(self, tokens: Sequence[int]) -> int:
        if not self.reports_cached:
            return 0
        bs = self.block_size
        n = 0
        for i in range(len(tokens) // bs):
            if engine_hash(tokens, (i + 1) * bs) not in self.cached:
                break
            n += 1
        return n * bs

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            start = decode_replay_request(frames)
            self.replay_requests.append(start)
            if self.replay_mode == "hold":
                self._held.append((frames[0], start))
                continue
            await self._answer_replay(frames[0], start)

    async def _answer_replay(self, ident: bytes, start: int) -> None:
        for seq, payload in list(self.buffer):
            if seq >= start:
                await self.router.send_multipart([ident, *encode_replay_reply(b"", seq, payload)])
        await self.router.send_multipart([ident, *encode_replay_end(b"")])

    async def release_replay(self) -> None:
        self.replay_mode = "answer"
        held, self._held = self._held, []
        for ident, start in held:
            await self._answer_replay(ident, start)

    # ------------------------------------------------------------- HTTP

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _metrics(self, request: Request) -> Response:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{self.model}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} 0.25\n'
        )
        if self.kv_capacity is not None:  # as vLLM prints it (one line per engine, value 1)
            text += (
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
                'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
                f'num_cpu_blocks="None",num_gpu_blocks="{self.kv_capacity}",'
                'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"} 1.0\n'
            )
        return PlainTextResponse(text)

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        text = render_byte_chat(body["messages"]) if "messages" in body else body["prompt"]
        tokens = list(text.encode())
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        tokens = list(prompt) if isinstance(prompt, list) else list(prompt.encode())
        return await self._generate(request, body, tokens, chat=False)

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        tokens = list(render_byte_chat(body["messages"]).encode())
        return await self._generate(request, body, tokens, chat=True)

    def _usage(self, tokens: list[int], cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": len(tokens),
            "completion_tokens": self.chunks,
            "total_tokens": len(tokens) + self.chunks,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _work(self, tokens: list[int]) -> None:
        await asyncio.sleep(self.first_token_delay_s)
        self._after_prefill(tokens)
        await asyncio.sleep(self.chunk_delay_s * self.chunks)

    def _after_prefill(self, tokens: list[int]) -> None:
        if self.publish_on_request:
            self.store(tokens)

    async def _generate(
        self, request: Request, body: dict[str, Any], tokens: list[int], *, chat: bool
    ) -> Response:
        self.requests.append(body)
        self.request_headers.append(dict(request.headers))
        cached = self.cached_prefix_tokens(tokens)
        rid = f"cmpl-{self.worker_id}-{len(self.requests)}"
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        if not body.get("stream"):
            self.running += 1
            # like vLLM's ``with_cancellation``: a client that goes away aborts the request
            work = asyncio.ensure_future(self._work(tokens))
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.running -= 1
                gone.cancel()
                if not work.done():
                    work.cancel()
                    self.cancelled += 1
            if not work.done() or work.cancelled():
                return Response(status_code=499)
            text = " ".join(["tok"] * self.chunks)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            self.completed += 1
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model,
                    "choices": [choice],
                    "usage": self._usage(tokens, cached),
                },
                headers={"x-worker": self.worker_id},
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> Any:
            self.running += 1
            done = False
            try:
                await asyncio.sleep(self.first_token_delay_s)
                self._after_prefill(tokens)
                for i in range(self.chunks):
                    if chat:
                        delta = (
                            {"content": f"tok{i} "}
                            if i
                            else {"role": "assistant", "content": "tok0 "}
                        )
                        choice = {"index": 0, "delta": delta, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": f"tok{i} ", "finish_reason": None}
                    chunk = {
                        "id": rid,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created,
                        "model": self.model,
                        "choices": [choice],
                    }
                    if include_usage:
                        chunk["usage"] = None
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(self.chunk_delay_s)
                if include_usage:
                    final = {
                        "id": rid,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created,
                        "model": self.model,
                        "choices": [],
                        "usage": self._usage(tokens, cached),
                    }
                    yield f"data: {json.dumps(final)}\n\n"
                yield "data: [DONE]\n\n"
                done = True
                self.completed += 1
            finally:
                self.running -= 1
                if not done:
                    self.cancelled += 1

        return StreamingResponse(events(), media_type="text/event-stream")
