"""What an SGLang-speaking router asks a worker about itself: ``GET /model_info``, ``/server_info``.

sglang-router (``python -m sglang_router.launch_router --worker-urls ...``) probes ``/health``, then
reads ``/model_info`` and ``/server_info`` to learn the worker's model; without them it registers
the worker under the model ``unknown`` and routes requests naming the served model by a fallback.
These answers carry SGLang's field names with this engine's values, so a bundled engine can stand
behind sglang-router (``kvrouter replay --mode live`` compares the two routers on one fleet).
Only fields that describe this engine truthfully are given; anything else is left out.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.state import EngineState, engine_state

__all__ = ["model_info", "router", "server_info"]

router = APIRouter()


def _model_path(st: EngineState) -> dict[str, str]:
    # sglang-router loads a tokenizer from model_path (a directory, or else a HuggingFace id it
    # downloads): give it only when the engine really runs from a local model directory
    model = st.settings.engine.model
    return {"model_path": model} if model and os.path.isdir(model) else {}


def model_info(st: EngineState) -> dict[str, Any]:
    return {
        **_model_path(st),
        "served_model_name": st.model,
        "is_generation": True,
        "max_context_length": st.settings.engine.model_len,
        "preferred_sampling_params": None,
    }


def server_info(st: EngineState) -> dict[str, Any]:
    cfg = st.settings.engine
    return {
        **_model_path(st),
        "served_model_name": st.model,
        "page_size": cfg.block_size,
        "context_length": cfg.model_len,
        "max_total_num_tokens": cfg.num_gpu_blocks * cfg.block_size,
        "max_running_requests": cfg.max_num_seqs,
        "chunked_prefill_size": cfg.max_num_batched_tokens,
        "disable_radix_cache": not cfg.enable_prefix_caching,
        "dp_size": 1,
        "kv_events_endpoint": st.events_endpoint,
    }


@router.get("/model_info")
async def _model_info(request: Request) -> JSONResponse:
    return JSONResponse(model_info(engine_state(request)))


@router.get("/server_info")
async def _server_info(request: Request) -> JSONResponse:
    return JSONResponse(server_info(engine_state(request)))
