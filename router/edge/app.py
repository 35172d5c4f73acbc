"""The router app: ``create_app(settings)`` wires the HTTP API onto a
:class:`router.runtime.Runtime` that its lifespan builds (index, subscriber task, HTTP client,
metrics registry, health checks, the Placer; the Envoy endpoint picker's gRPC server when
``epp.port`` is set: ``app.state.epp``, its port ``app.state.epp_port``) and tears down. A
:class:`router.errors.RouterError` that stops it before serving is kept in
``app.state.startup_error`` (a worker's as :class:`router.errors.WorkerUnusable`), for
``kvrouter serve`` to say in one line. No module-level mutable state: two apps in one process
share nothing.

``/route`` and the two OpenAI endpoints are plain ASGI endpoints that
:class:`router.edge.dispatch.RouterApp` dispatches ahead of FastAPI; the rest
(:mod:`router.edge.admin`) are plain Starlette routes on the FastAPI app. Every error is JSON
``{"error": {"message", "type", "param", "code"}}`` with the status of :mod:`router.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from router.edge import admin
from router.edge.access import AccessLog
from router.edge.bodies import error_response
from router.edge.dispatch import RouterApp
from router.edge.proxy import AsgiProxy
from router.edge.route import RouteEndpoint
from router.errors import ConfigError, RouterError, WorkerUnusable
from router.runtime import Runtime
from router.runtime.replicas import SNAPSHOT_PATH, warm_index, warm_urls
from router.settings import Settings

if TYPE_CHECKING:
    from router.edge.epp.server import EppServer

__all__ = ["create_app"]

log = logging.getLogger("kvrouter.app")
_HOUSEKEEPING_S = 0.5


# ------------------------------------------------------------------------------ wiring


async def _router_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    state = getattr(request.app.state, "kv", None)
    if state is not None:
        state.metrics.rejected.labels(str(exc.status)).inc()
    return error_response(exc.status, exc.message, exc.type, param=exc.param)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), kind, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal router error", "internal_error")


async def _housekeeping(state: Runtime) -> None:
    while True:
        await asyncio.sleep(_HOUSEKEEPING_S)
        state.placer.housekeeping()


async def _snapshots(state: Runtime) -> None:
    while True:
        await asyncio.sleep(state.settings.snapshot.interval_s)
        await state.write_snapshot()


def create_app(settings: Settings, *, process: int = 0) -> RouterApp:
    """``process``: this process's index under ``server.processes`` (router.edge.processes)."""
    discovery = None
    if settings.kubernetes.discovery.enabled:  # workers from pods (the `k8s` extra)
        from router.fleet.discovery import KubernetesDiscovery

        discovery = KubernetesDiscovery(settings.kubernetes.discovery)

    tracing = None
    if settings.tracing.otlp_endpoint is not None:
        from router.edge.tracing import Tracing, inject_trace_headers

        tracing = Tracing(settings.tracing)  # ConfigError here, at start, without the extra

    epp_server: type[EppServer] | None = None
    if settings.epp.port is not None:  # the Envoy endpoint picker (the `epp` extra)
        try:
            from router.edge.epp.server import EppServer
        except ImportError as e:
            raise ConfigError(
                f"epp.port needs the epp extra (pip install -e '.[epp]' in the kvrouter checkout): {e}"
            ) from e
        epp_server = EppServer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        t0 = time.monotonic()
        warm = await warm_index(settings, await warm_urls(settings))  # a peer's index, or None
        try:  # (the tokenizer is loaded here: a bad hf: directory is a ConfigError)
            state = Runtime(settings, warm=warm, process=process)
        except RouterError as e:  # kept for kvrouter serve, which says it in one line
            app.state.startup_error = e
            raise
        serving = False
        if tracing is not None:
            state.trace_headers = inject_trace_headers()
        tasks: list[asyncio.Task[None]] = []
        epp: EppServer | None = None
        try:
            await state.subscriber.start()
            for w in settings.workers:
                try:
                    await state.add_worker(w)
                except RouterError as e:  # (POST /workers answers it 400; at start, not there)
                    raise WorkerUnusable(e.message) from e
            configured = {w.id for w in settings.workers}
            for key in state.index.workers():  # restored ranks of workers no longer configured
                if key[0] not in configured and discovery is None:  # (the subscriber task drops
                    await state.subscriber.remove_worker(key[0])  # them: one writer)
            if discovery is not None:  # its pods claim restored ranks; the rest go later
                tasks.append(asyncio.create_task(discovery.run(state), name="k8s-discovery"))
                tasks.append(asyncio.create_task(state.drop_unclaimed(), name="unclaimed-ranks"))
            if state.replicas is not None:  # replica sync (router.runtime.replicas)
                await state.replicas.start()
            tasks.append(asyncio.create_task(state.log_time_to_ready(t0, warm), name="ready-log"))
            tasks.append(asyncio.create_task(state.health.run(), name="health"))
            tasks.append(asyncio.create_task(_housekeeping(state), name="housekeeping"))
            tasks.append(asyncio.create_task(state.check_tokenizer(), name="tokenizer-check"))
            if settings.snapshot.path:
                tasks.append(asyncio.create_task(_snapshots(state), name="snapshots"))
            if epp_server is not None:  # gRPC on this loop, next to uvicorn
                app.state.epp = epp = epp_server(state)
                app.state.epp_port = await epp.start()
            app.state.kv = state
            serving = True
            yield
        except RouterError as e:
            if not serving:  # kept for kvrouter serve, which says it in one line
                app.state.startup_error = e
            raise
        finally:
            if epp is not None:  # first: its streams end their flights on a whole runtime
                await epp.stop()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if tasks:  # it ran: keep what it learned for the next start
                await state.write_snapshot()
            if state.replicas is not None:
                await state.replicas.aclose()
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
        # router/edge/tracing.py, and a second server span per request would cost and confuse
        telemetry={"tracing": False, "metrics": False, "logs": False, "auto_configure": False},
    )
    api.state.settings = settings
    api.add_exception_handler(RouterError, _router_error)
    api.add_exception_handler(HTTPException, _http_error)
    api.add_exception_handler(Exception, _internal_error)
    add = api.add_route
    add("/route/{route_id}/release", admin.release_route, methods=["POST"])
    add("/v1/models", admin.models, methods=["GET"])
    add("/workers", admin.list_workers, methods=["GET"])
    add("/workers", admin.add_worker, methods=["POST"])
    add("/workers/{worker_id}", admin.delete_worker, methods=["DELETE"])
    add("/health", admin.health, methods=["GET"])
    add("/ready", admin.ready, methods=["GET"])
    add("/metrics", admin.metrics, methods=["GET"])
    add(SNAPSHOT_PATH, admin.snapshot, methods=["GET"])
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

    from router.edge.openapi import openapi_document
    from router.observe.metrics import installed_version

    document = msgspec.json.encode(openapi_document(installed_version()))

    async def openapi_json(request: Request) -> Response:
        return Response(document, media_type="application/json")

    async def docs(request: Request) -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvrouter API")

    app.add_route("/openapi.json", openapi_json, methods=["GET"])
    app.add_route("/docs", docs, methods=["GET"])
