"""The router app: ``create_app(settings)`` wires the HTTP API onto a :class:`RouterState` that
its lifespan builds (index, subscriber task, HTTP client, metrics registry, health checks) and
tears down. No module-level mutable state: two apps in one process share nothing.

``/route`` and the two OpenAI endpoints are plain ASGI endpoints that :class:`router.edge.RouterApp`
dispatches ahead of FastAPI; the rest are plain Starlette routes on the FastAPI app, returning
msgspec-encoded bytes (no dependency solving, no pydantic serialization). Every error is JSON
``{"error": {"message", "type", "param", "code"}}`` with the status of :mod:`router.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from router.access import AccessLog
from router.api import WorkerIn, decode, encode, read_body
from router.edge import RouterApp
from router.errors import (
    BadRequest,
    Forbidden,
    NotFound,
    RouterError,
    error_response,
    require_bearer,
)
from router.placement import RouteEndpoint
from router.proxy import AsgiProxy
from router.service import RouterState
from router.settings import Settings, WorkerConfig

__all__ = ["create_app"]

log = logging.getLogger("kvrouter.app")
_JSON = "application/json"
_HOUSEKEEPING_S = 0.5


def _json(obj: Any, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type=_JSON)


def _state(request: Request) -> RouterState:
    return request.app.state.kv


def _require_admin(state: RouterState, request: Request) -> None:
    """Admin endpoints (the worker registry: it lists internal endpoints, and a registration makes
    the router call the URL it names) are closed unless an admin key is configured and given, or
    the operator opened them explicitly (``admin_open``, for a trusted network)."""
    key = state.settings.admin_key
    if not key:
        if state.settings.admin_open:
            return
        raise Forbidden(
            "admin endpoints are closed: configure admin_key (or admin_open: true on a trusted "
            "network)"
        )
    require_bearer(request.headers.get("authorization"), [key], "this endpoint (the admin key)")


# ------------------------------------------------------------------------------ /route


async def release_route(request: Request) -> Response:
    state = _state(request)
    route_id = request.path_params["route_id"]
    if not state.accounts.release(route_id):
        raise NotFound(f"route {route_id!r} is unknown, released or expired")
    return _json({"released": route_id})


# ------------------------------------------------------------------------------ OpenAI


async def models(request: Request) -> Response:
    state = _state(request)
    if state.settings.api_keys:
        require_bearer(request.headers.get("authorization"), state.settings.api_keys, "/v1/models")
    if any(not st.models() for st in state.registry.states()):
        await state.registry.check_all(state.upstream)
    names = sorted(state.registry.known_models())
    created = int(state.started_at)
    data = [{"id": m, "object": "model", "created": created, "owned_by": "kvrouter"} for m in names]
    return _json({"object": "list", "data": data})


# ------------------------------------------------------------------------------ workers


def _worker_view(state: RouterState, worker_id: str) -> dict[str, Any]:
    st = state.registry.workers[worker_id]
    stats = state.subscriber.stats()
    cfg = st.config
    since = state.subscriber.seconds_since_last_message(cfg.id)
    ranks = []
    for key in st.keys:
        ws = stats.get(key)
        ld = state.load.get(key)
        ranks.append(
            {
                "dp_rank": key[1],
                "subscriber": ws.as_dict() if ws is not None else None,
                "inflight_requests": ld.requests if ld is not None else 0,
                "inflight_prefill_blocks": ld.inflight_prefill if ld is not None else 0.0,
                "active_blocks": ld.active_blocks if ld is not None else 0,
            }
        )
    return {
        "id": cfg.id,
        "url": cfg.url,
        "events_endpoint": cfg.events_endpoint,
        "replay_endpoint": cfg.replay_endpoint,
        "dp_ranks": cfg.dp_ranks,
        "pool": cfg.pool,
        "model": cfg.model,
        "models": sorted(st.models()),
        "dynamic": st.dynamic,
        "healthy": st.healthy,
        "ready": state.subscriber.worker_ready(cfg.id),
        "last_check": st.last_check,
        "last_error": st.last_error,
        "inflight_requests": state.load.inflight(cfg.id),
        "scraped_load": st.scraped,
        "seconds_since_last_event": since,
        "events_stale": state.registry.events_stale(st, since),
        "ranks": ranks,
    }


async def list_workers(request: Request) -> Response:
    state = _state(request)
    _require_admin(state, request)
    return _json({"workers": [_worker_view(state, w) for w in state.registry.workers]})


async def add_worker(request: Request) -> Response:
    state = _state(request)
    _require_admin(state, request)
    w = decode(await read_body(request, 65536), WorkerIn)
    try:
        cfg = WorkerConfig(
            id=w.id,
            url=w.url,
            events_endpoint=w.events_endpoint,
            replay_endpoint=w.replay_endpoint,
            dp_ranks=w.dp_ranks,
            pool=w.pool,
            model=w.model,
        )
    except ValueError as e:  # __post_init__ checks: "`url` must be an http(s) URL"
        raise BadRequest(str(e).replace("`", "")) from e
    await state.add_worker(cfg, dynamic=True)
    return _json(_worker_view(state, cfg.id), status=201)


async def delete_worker(request: Request) -> Response:
    state = _state(request)
    _require_admin(state, request)
    worker_id = request.path_params["worker_id"]
    await state.remove_worker(worker_id)
    return _json({"deleted": worker_id})


# ------------------------------------------------------------------------------ ops


async def health(request: Request) -> Response:
    return _json({"status": "ok"})


async def ready(request: Request) -> Response:
    ok, waiting = _state(request).ready()
    return _json({"ready": ok, "waiting_for": waiting}, status=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state = _state(request)
    state.housekeeping()
    # generated on the loop: the collector reads the index, which only the loop may touch
    return Response(generate_latest(state.prom), media_type=CONTENT_TYPE_LATEST)


# ------------------------------------------------------------------------------ wiring


async def _router_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    state = getattr(request.app.state, "kv", None)
    if state is not None:
        state.metrics.rejected.labels(str(exc.status)).inc()
    return error_response(exc.status, exc.message, exc.type)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), kind, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal router error", "internal_error")


async def _housekeeping(state: RouterState) -> None:
    while True:
        await asyncio.sleep(_HOUSEKEEPING_S)
        state.housekeeping()


async def _snapshots(state: RouterState) -> None:
    while True:
        await asyncio.sleep(state.settings.snapshot.interval_s)
        state.write_snapshot()


def create_app(settings: Settings) -> RouterApp:
    discovery = None
    if settings.kubernetes.discovery.enabled:  # workers from pods (the `k8s` extra)
        from router.discovery import KubernetesDiscovery

        discovery = KubernetesDiscovery(settings.kubernetes.discovery)

    tracing = None
    if settings.tracing.otlp_endpoint is not None:
        from router.tracing import Tracing, inject_trace_headers

        tracing = Tracing(settings.tracing)  # ConfigError here, at start, without the extra

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = RouterState(settings)
        if tracing is not None:
            state.trace_headers = inject_trace_headers()
        tasks: list[asyncio.Task[None]] = []
        try:
            await state.subscriber.start()
            for w in settings.workers:
                await state.add_worker(w)
            configured = {w.id for w in settings.workers}
            for key in state.index.workers():  # restored ranks of workers no longer configured
                if key[0] not in configured:  # (the subscriber task drops them: one writer)
                    await state.subscriber.remove_worker(key[0])
            if discovery is not None:
                tasks.append(asyncio.create_task(discovery.run(state), name="k8s-discovery"))
            tasks.append(asyncio.create_task(state.registry.run(state.upstream), name="health"))
            tasks.append(asyncio.create_task(_housekeeping(state), name="housekeeping"))
            tasks.append(asyncio.create_task(state.check_tokenizer(), name="tokenizer-check"))
            if settings.snapshot.path:
                tasks.append(asyncio.create_task(_snapshots(state), name="snapshots"))
            app.state.kv = state
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if tasks:  # it ran: keep what it learned for the next start
                state.write_snapshot()
            await state.subscriber.aclose()
            await state.upstream.aclose()
            if tracing is not None:  # flush the queued spans (blocking HTTP: off the loop)
                await asyncio.to_thread(tracing.shutdown)

    api = FastAPI(
        title="kvrouter",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # FastAPI's own OpenTelemetry (>= 0.142) stays off: the router's tracing is
        # router/tracing.py, and a second server span per request would cost and confuse
        telemetry={"tracing": False, "metrics": False, "logs": False, "auto_configure": False},
    )
    api.state.settings = settings
    api.add_exception_handler(RouterError, _router_error)
    api.add_exception_handler(HTTPException, _http_error)
    api.add_exception_handler(Exception, _internal_error)
    add = api.add_route
    add("/route/{route_id}/release", release_route, methods=["POST"])
    add("/v1/models", models, methods=["GET"])
    add("/workers", list_workers, methods=["GET"])
    add("/workers", add_worker, methods=["POST"])
    add("/workers/{worker_id}", delete_worker, methods=["DELETE"])
    add("/health", health, methods=["GET"])
    add("/ready", ready, methods=["GET"])
    add("/metrics", metrics, methods=["GET"])
    if settings.server.docs:
        _add_docs(api)
    hot: dict[str, ASGIApp] = {
        "/route": RouteEndpoint(api.state),
        "/v1/completions": AsgiProxy("completions", api.state),
        "/v1/chat/completions": AsgiProxy("chat", api.state),
    }

    def wrap(app: ASGIApp) -> ASGIApp:
        app = AccessLog(app)  # every request, the hot paths included
        if tracing is not None:  # outermost: the span covers the access log too
            cls, kw = tracing.middleware()
            app = cls(app, **kw)
        return app

    return RouterApp(api, hot, wrap)


def _add_docs(app: FastAPI) -> None:
    """``GET /openapi.json`` (built once from the API's Structs) and ``GET /docs`` (Swagger UI;
    the browser loads its script from a CDN, the router fetches nothing)."""
    from fastapi.openapi.docs import get_swagger_ui_html

    from router.metrics import installed_version
    from router.openapi import openapi_document

    document = msgspec.json.encode(openapi_document(installed_version()))

    async def openapi_json(request: Request) -> Response:
        return Response(document, media_type="application/json")

    async def docs(request: Request) -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvrouter API")

    app.add_route("/openapi.json", openapi_json, methods=["GET"])
    app.add_route("/docs", docs, methods=["GET"])
