"""The router's endpoints other than the hot paths, as plain Starlette routes on the FastAPI app:
the worker registry (admin key), ``/route/{id}/release``, ``/v1/models``, the operator's
``/health``, ``/ready`` and ``/metrics``, and the index snapshot a peer replica warm-starts from
(``/admin/snapshot``, the peer key's token or the admin key). Each answers msgspec-encoded bytes (no dependency
solving, no pydantic serialization); errors are :mod:`router.errors` exceptions, which the app
turns into OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from router.edge.bodies import WorkerIn, decode, encode, read_body
from router.errors import BadRequest, Forbidden, NotFound, require_bearer
from router.fleet.capacity import Capacity
from router.runtime import Runtime
from router.runtime.replicas import SNAPSHOT_TYPE
from router.settings import WorkerConfig
from router.types import WorkerKey

__all__ = [
    "add_worker",
    "delete_worker",
    "health",
    "list_workers",
    "metrics",
    "models",
    "ready",
    "release_route",
    "snapshot",
]

_JSON = "application/json"


_WORKER_FIELDS = WorkerIn.__struct_fields__  # each a WorkerConfig field of that name


def _json(obj: Any, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type=_JSON)


def _state(request: Request) -> Runtime:
    return request.app.state.kv


def _require_admin(state: Runtime, request: Request) -> None:
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
    if not state.placer.accounts.release(route_id):
        raise NotFound(f"route {route_id!r} is unknown, released or expired")
    return _json({"released": route_id})


# ------------------------------------------------------------------------------ OpenAI


async def models(request: Request) -> Response:
    state = _state(request)
    if state.settings.api_keys:
        require_bearer(request.headers.get("authorization"), state.settings.api_keys, "/v1/models")
    if any(not st.models() for st in state.registry.states()):
        await state.health.check_all()
    names = sorted(state.registry.known_models())
    created = int(state.started_at)
    data = [{"id": m, "object": "model", "created": created, "owned_by": "kvrouter"} for m in names]
    return _json({"object": "list", "data": data})


# ------------------------------------------------------------------------------ workers


def _worker_view(state: Runtime, worker_id: str) -> dict[str, Any]:
    st = state.registry.workers[worker_id]
    stats = state.subscriber.stats()
    cfg = st.config
    since = state.subscriber.seconds_since_last_message(cfg.id)
    ranks = []
    caps = st.kv_capacity or [None] * len(st.keys)
    for key, cap in zip(st.keys, caps):
        ws = stats.get(key)
        ld = state.placer.load.get(key)
        ranks.append(
            {
                "dp_rank": key[1],
                "source": _source(state, key),
                "subscriber": ws.as_dict() if ws is not None else None,
                "inflight_requests": ld.requests if ld is not None else 0,
                "inflight_prefill_blocks": ld.inflight_prefill if ld is not None else 0.0,
                "active_blocks": ld.active_blocks if ld is not None else 0,
                **_kv_size(state, key, cap),
            }
        )
    return {
        "id": cfg.id,
        "url": cfg.url,
        "role": cfg.role,
        "bootstrap_port": cfg.bootstrap_port,
        "events_endpoint": cfg.events_endpoint,
        "source": _source(state, st.keys[0]),
        # the closed loop's verdict on its reported cached tokens (router.placement.loop)
        "agreement": state.placer.loop.verdict(cfg.id),
        "kv_blocks": cfg.kv_blocks,
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
        "inflight_requests": state.placer.load.inflight(cfg.id),
        "scraped_load": st.scraped,
        "seconds_since_last_event": since,
        "events_stale": state.registry.events_stale(st, since),
        "ranks": ranks,
    }


def _source(state: Runtime, key: WorkerKey) -> str:
    """Where the rank's index entries come from: its KV events, or what the router sent it."""
    return "approximate" if state.index.approximate(key) else "events"


def _kv_size(state: Runtime, key: WorkerKey, capacity: Capacity | None) -> dict[str, Any]:
    """A rank's KV ``capacity`` in engine blocks per tier as the worker reported it (None: not
    known; its index entries are then capped by the default) and its engine ``page`` size when
    its events' block size differs from the router's (0: the same, or no event yet)."""
    try:
        page = state.index.worker(key).page
    except KeyError:  # (not in the index yet)
        page = 0
    return {"capacity": capacity, "page": page}


async def list_workers(request: Request) -> Response:
    state = _state(request)
    _require_admin(state, request)
    return _json({"workers": [_worker_view(state, w) for w in state.registry.workers]})


async def add_worker(request: Request) -> Response:
    state = _state(request)
    _require_admin(state, request)
    w = decode(await read_body(request, 65536), WorkerIn)
    try:
        cfg = WorkerConfig(**{f: getattr(w, f) for f in _WORKER_FIELDS})
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
    """``Runtime.ready``: what the EPP's gRPC health check answers too."""
    ok, waiting = _state(request).ready()
    return _json({"ready": ok, "waiting_for": waiting}, status=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state = _state(request)
    state.placer.housekeeping()
    # generated on the loop: the collector reads the index, which only the loop may touch
    return Response(generate_latest(state.prom), media_type=CONTENT_TYPE_LATEST)


def _require_peer(state: Runtime, request: Request) -> None:
    """The snapshot lists every worker's cache: a peer shows the token derived from the shared
    peer key (``replicas.peer_key_file``, :meth:`PeerKey.snapshot_token`), so a warm start
    never sends the admin key; the admin key (an operator, or a peer in the trusted-network
    mode, which has no peer key) is taken too."""
    key = state.peer_key
    if key is None:
        _require_admin(state, request)
        return
    keys = [key.snapshot_token()]
    if state.settings.admin_key:
        keys.append(state.settings.admin_key)
    what = "/admin/snapshot (the peer key's token or the admin key)"
    require_bearer(request.headers.get("authorization"), keys, what)


async def snapshot(request: Request) -> Response:
    """The index and each worker rank's last applied seq (``indexer.index.snapshot``'s format),
    for a peer replica's warm start (router.runtime.replicas.warm). Keyed (``_require_peer``):
    it lists every worker's cache. Read on the loop, like every index read (its size is the
    index's, which its caps bound), a rank at a time (``Runtime.snapshot_bytes``)."""
    state = _state(request)
    _require_peer(state, request)
    data = await state.snapshot_bytes()
    headers = {"x-kvrouter-block-size": str(state.index.block_size)}
    return Response(data, media_type=SNAPSHOT_TYPE, headers=headers)
