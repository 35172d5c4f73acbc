"""The engine's inspection and cache-control routes: ``GET /metrics`` (Prometheus, vLLM's names),
``POST /reset_prefix_cache`` (vLLM's),
``GET /debug/blocks`` (the hashes each tier holds) and ``GET /debug/kv_transfers`` (the PD
side: role, epoch, block endpoint, the prefill side's leases and the decode side's pulls)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.engine import LLMEngine
from engine.pd.kv_io import REMOTE
from engine.state import engine_state

__all__ = ["router"]

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = engine_state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset_prefix_cache")
async def reset(request: Request) -> Response:
    await engine_state(request).engine.call(lambda core: core.reset_prefix_cache())
    return JSONResponse({"status": "ok"})


@router.get("/debug/blocks")
async def blocks(request: Request) -> Response:
    st = engine_state(request)
    listing = await st.engine.call(lambda core: core.block_listing())
    body = {tier: sorted(f"{h:016x}" for h in hs) for tier, hs in listing.items()}
    return JSONResponse({"block_size": st.settings.engine.block_size, "tiers": body})


def _core_side(core: LLMEngine) -> dict[str, Any]:
    core.leases.expire()
    t = core.leases
    return {
        "leases": {"held": len(t), "blocks": t.num_blocks, "ended": dict(t.ended)},
        # pulled blocks that reached this engine's GPU (the rest were computed here)
        "loaded_blocks": core.tiers.loaded_blocks.get(REMOTE, 0),
    }


@router.get("/debug/kv_transfers")
async def kv_transfers(request: Request) -> Response:
    st = engine_state(request)
    return JSONResponse({**st.pd.snapshot(), **await st.engine.call(_core_side)})
