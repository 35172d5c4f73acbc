"""The engine's HTTP server: OpenAI completions/chat, tokenize, metrics, cache control
(and SGLang's worker info endpoints, from :mod:`engine.sglang_compat`).

``create_app(settings)`` builds everything; the lifespan owns the engine core, its loop thread,
the ZMQ publisher and the metrics registry, held in an :class:`engine.state.EngineState` at
``app.state.kv``. No module-level state. Errors are ``{"error": {"message", "type"}}`` like the
router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine import cache_routes, sglang_compat
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import ServerSettings
from engine.engine import InvalidRequestError, LLMEngine, RequestOutput
from engine.metrics import EngineMetrics, RequestTimer, cache_config_labels
from engine.pd.legs import PdNode, PdRequestError
from engine.pd.params import KvTransferError
from engine.protocol import (
    ChatRequest,
    CompletionRequest,
    StopChecker,
    TokenizeRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    decode_body,
    error_body,
    new_id,
    usage,
)
from engine.publisher import EventPublisher
from engine.runner.base import SamplingParams
from engine.sequence import Request as EngineRequest
from engine.state import EngineState, engine_state
from engine.tokenizer import ChatTemplateError, load_tokenizer

__all__ = ["ApiError", "create_app"]


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_


def create_app(
    settings: ServerSettings, *, core_factory: Callable[[], LLMEngine] | None = None
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cfg = settings.engine
        core = await asyncio.to_thread(core_factory or (lambda: LLMEngine(cfg)))
        publisher, pd = None, None
        try:
            if settings.events:
                publisher = EventPublisher(
                    settings.events,
                    settings.replay,
                    topic=settings.topic,
                    dp_rank=settings.dp_rank,
                    buffer_size=settings.replay_buffer,
                )
            tokenizer = load_tokenizer(cfg.tokenizer or core.runner.tokenizer_path)
            engine = AsyncEngine(core, publisher)
            pd = PdNode.of(engine, settings)
            model = cfg.model_name
            app.state.kv = EngineState(
                settings,
                engine,
                tokenizer,
                EngineMetrics(
                    model,
                    lambda: engine.stats,
                    cache_config_labels(cfg, settings.dp_rank),
                    pd.counters,
                ),
                publisher,
                model,
                await pd.start(),
            )
            engine.start()
        except BaseException:
            if pd is not None:
                await pd.close()
            if publisher is not None:
                publisher.close()
            core.close()
            raise
        try:
            yield
        finally:
            await pd.close()
            await engine.stop()
            if publisher is not None:
                publisher.close()
            await asyncio.to_thread(core.close)

    app = FastAPI(title="kvrouter engine", lifespan=lifespan)
    app.include_router(sglang_compat.router)  # /model_info, /server_info for sglang-router
    app.include_router(cache_routes.router)  # /metrics, /reset_prefix_cache, /debug/...

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc.status, exc.message, exc.type)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> Response:
        return _error(503, str(exc), "service_unavailable")

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no route {request.method} {request.url.path}", "not_found_error")

    @app.exception_handler(405)
    async def _not_allowed(request: Request, exc: Exception) -> Response:
        return _error(405, f"method {request.method} not allowed here", "invalid_request_error")

    @app.get("/health")
    async def health(request: Request) -> Response:
        st = engine_state(request)
        if not st.engine.alive:
            return _error(503, f"engine loop stopped: {st.engine.error}", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        st = engine_state(request)
        card = {
            "id": st.model,
            "object": "model",
            "created": 0,
            "owned_by": "kvrouter",
            "root": st.model,
            "max_model_len": st.settings.engine.model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        st = engine_state(request)
        body = _decode(await request.body(), TokenizeRequest)
        _check_model(st, body.model)
        if body.messages is not None:
            ids = _chat_ids(st, body.messages)
        elif body.prompt is not None:
            ids = st.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise ApiError(400, "give prompt or messages")
        return JSONResponse(
            {"count": len(ids), "max_model_len": st.settings.engine.model_len, "tokens": ids}
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        st = engine_state(request)
        body = _decode(await request.body(), CompletionRequest)
        _check_model(st, body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = st.tokenizer.encode(prompt)
        elif prompt and all(type(t) is int for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise ApiError(400, "batched prompts are not supported: send one prompt per request")
        return await _serve(request, st, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        st = engine_state(request)
        body = _decode(await request.body(), ChatRequest)
        _check_model(st, body.model)
        if not body.messages:
            raise ApiError(400, "messages must not be empty")
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        return await _serve(request, st, body, _chat_ids(st, body.messages), chat=True)

    return app


# ---------------------------------------------------------------------------------- helpers


def _error(status: int, message: str, type_: str) -> Response:
    return Response(error_body(message, type_), status_code=status, media_type="application/json")


def _decode(raw: bytes, kind: type[Any]) -> Any:
    try:
        return decode_body(raw, kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc


def _check_model(st: EngineState, model: str | None) -> None:
    if model and model != st.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "not_found_error")


def _chat_ids(st: EngineState, messages: list[dict[str, Any]]) -> list[int]:
    try:
        text = st.tokenizer.apply_chat_template(messages)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc)) from exc
    return st.tokenizer.encode(text, add_special_tokens=False)


def _engine_request(
    st: EngineState, body: CompletionRequest | ChatRequest, ids: list[int]
) -> EngineRequest:
    if body.n != 1:
        raise ApiError(400, "only n=1 is supported")
    limit = st.settings.engine.model_len
    max_tokens = body.max_tokens if body.max_tokens is not None else max(1, limit - len(ids))
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if temperature < 0 or not 0 < top_p <= 1:
        raise ApiError(400, "temperature must be >= 0 and top_p in (0, 1]")
    return EngineRequest(
        request_id=new_id("cmpl" if isinstance(body, CompletionRequest) else "chatcmpl"),
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=body.seed),
        ignore_eos=body.ignore_eos,
    )


async def _serve(
    request: Request,
    st: EngineState,
    body: CompletionRequest | ChatRequest,
    ids: list[int],
    *,
    chat: bool,
) -> Response:
    req = _engine_request(st, body, ids)
    try:
        await st.pd.prepare(body.kv_transfer_params, req, body.stream)
    except PdRequestError as exc:
        raise ApiError(400, str(exc)) from exc
    except KvTransferError as exc:  # --kv-load-failure-policy fail, vLLM's 500
        raise ApiError(500, f"KV load failed: {exc}", "internal_server_error") from exc
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    timer = RequestTimer(st.metrics, time.monotonic())
    outputs = st.engine.generate(req)
    first: RequestOutput | None = None
    if not (body.stream and st.settings.stream_head == "at-once"):
        first = await _first(st, outputs, timer)  # (400 too long) before any byte is sent
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _stream(st, req.request_id, first, outputs, stops, chat, include_usage, timer)
        return StreamingResponse(gen, media_type="text/event-stream")
    assert first is not None
    return await _until_done(request, st, req, first, outputs, stops, chat, timer)


async def _first(
    st: EngineState, outputs: AsyncIterator[RequestOutput], timer: RequestTimer
) -> RequestOutput:
    """The first output (the prefill done), timed as the TTFT; a request the engine refuses at
    admission is a 400."""
    try:
        first = await outputs.__anext__()
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc)) from exc
    timer.first()
    return first


async def _collect_text(
    st: EngineState, first: RequestOutput, outputs: AsyncIterator[RequestOutput], stop: StopChecker
) -> AsyncIterator[tuple[str, RequestOutput]]:
    detok = st.tokenizer.detokenizer()
    out = first
    while True:
        delta = stop.feed(detok.feed(out.new_token_ids))
        if out.finished and not stop.stopped:
            delta += stop.feed(detok.flush()) + stop.flush()
        yield delta, out
        if out.finished or stop.stopped:
            return
        out = await outputs.__anext__()


async def _until_done(
    request: Request,
    st: EngineState,
    req: EngineRequest,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    stops: list[str],
    chat: bool,
    timer: RequestTimer,
) -> Response:
    stop = StopChecker(stops)

    async def consume() -> RequestOutput:
        last = first
        async for _, out in _collect_text(st, first, outputs, stop):
            last = out
        return last

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
    finally:
        if not task.done():
            task.cancel()
        await _close(outputs)
    try:
        last = task.result()
    except asyncio.CancelledError:
        return _error(499, "client disconnected", "client_closed_request")
    finish = "stop" if stop.stopped else last.finish_reason
    use = usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
    timer.done(last.num_output_tokens)
    build = chat_response if chat else completion_response
    answer = build(req.request_id, st.model, stop.text, finish, use)
    if req.kv_hold and (kv := st.pd.answer_params(last)) is not None:
        answer["kv_transfer_params"] = kv  # a prefill leg: where its blocks wait
    return JSONResponse(answer)


async def _stream(
    st: EngineState,
    rid: str,
    first: RequestOutput | None,
    outputs: AsyncIterator[RequestOutput],
    stops: list[str],
    chat: bool,
    include_usage: bool,
    timer: RequestTimer,
) -> AsyncIterator[bytes]:
    """The SSE answer. ``first`` None (``--stream-head at-once``): the head went before the
    prefill, as vLLM sends it, so the first output is awaited here, and a request the engine
    refuses at admission ends as an SSE error event."""
    stop = StopChecker(stops)
    try:
        if first is None:
            try:
                first = await _first(st, outputs, timer)
            except ApiError as exc:
                yield b"data: " + error_body(exc.message, exc.type) + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
        last = first
        if chat:
            yield _sse(chat_chunk(rid, st.model, {"role": "assistant", "content": ""}, None))
        async for delta, last in _collect_text(st, first, outputs, stop):
            done = last.finished or stop.stopped
            finish = ("stop" if stop.stopped else last.finish_reason) if done else None
            if not delta and not done:
                continue
            if chat:
                yield _sse(chat_chunk(rid, st.model, {"content": delta} if delta else {}, finish))
            else:
                yield _sse(completion_chunk(rid, st.model, delta, finish))
        if include_usage:
            use = usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
            chunk = (
                chat_chunk(rid, st.model, None, None, use)
                if chat
                else completion_chunk(rid, st.model, None, None, use)
            )
            yield _sse(chunk)
        yield b"data: [DONE]\n\n"
        timer.done(last.num_output_tokens)
    finally:
        # client gone (the response task is cancelled) or stop string: abort the sequence
        await _close(outputs)


async def _close(outputs: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
