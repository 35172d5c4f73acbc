"""``POST /route``: the placement answer.

The answer is built from msgspec Structs and encoded once: the pick (the placement core's
:meth:`router.placement.Placer.pick`), every candidate, and for a disaggregated fleet the
decision and each leg's patch (:func:`router.edge.legs.route_legs`), with the same
``x-kvrouter-*`` headers as the proxy's (:func:`router.edge.door.pick_headers`). A body with
``token_ids`` is answered without awaiting; one with ``prompt`` or ``messages`` may wait for a
tokenizer (:func:`route_answer`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from router.edge.bodies import (
    CandidateOut,
    JsonTokens,
    RouteOut,
    RouteRequest,
    check_messages,
    decode_route,
    encode,
    read_body,
)
from router.edge.door import authorize, pick_headers
from router.edge.legs import route_legs
from router.errors import BadRequest, RouterError, error_json
from router.placement.scoring import tier_breakdown
from router.runtime import Runtime

__all__ = ["RouteEndpoint", "route_answer"]

_rng = random.SystemRandom()  # SGLang bootstrap rooms


async def route_answer(
    state: Runtime, body: bytes, t0: float | None = None
) -> tuple[bytes, list[tuple[str, str]]]:
    """The JSON answer to a ``/route`` body (decoded once) and the pick's headers (the same
    as the proxy's and the picker's: :func:`router.edge.door.pick_headers`); raises
    :class:`RouterError` subclasses. With ``token_ids`` it never awaits; text waits for the
    tokenizer."""
    if t0 is None:
        t0 = time.perf_counter()
    req, json_tokens = decode_route(body)
    tokens: list[int] | JsonTokens
    if json_tokens is not None:
        tokens = json_tokens
    elif req.prompt is not None:
        tokens = await state.tokenizer.encode(req.prompt, req.model)
    elif req.messages:
        check_messages(req.messages)
        tokens = await state.tokenizer.encode_chat(req.messages, req.model)
    else:
        raise BadRequest("one of token_ids, prompt or messages is required")
    return _answer(state, req, tokens, t0)


def _answer(
    state: Runtime, req: RouteRequest, tokens: list[int] | JsonTokens, t0: float
) -> tuple[bytes, list[tuple[str, str]]]:
    placer = state.placer
    d = placer.place(tokens, req.model, req.lora_name, req.cache_salt, max_tokens=req.max_tokens)
    pick = placer.pick(d)
    dc = pick.decode
    best, c = dc.index, dc.cand
    route_id = None
    p = pick.prefill
    if req.account:
        if p is not None:  # both legs, each ended by its worker's events or the release
            pf = placer.fly(d, p.index, "route_account", t0=t0, by_events=True, leg="prefill")
            df = placer.fly(d, best, "route_account", t0=t0, by_events=True, leg="decode")
            route_id = placer.accounts.add(df, pf)
        else:
            flight = placer.fly(d, best, "route_account", t0=t0, by_events=True)
            route_id = placer.accounts.add(flight)
    else:
        placer.chose(d, best, "route")
        if p is not None:
            placer.chose(d, p.index, "route")
    breakdowns: dict[int, dict[str, int]] = {}
    approximate = state.index.approximate
    out = RouteOut(
        worker_id=c.key[0],
        dp_rank=c.key[1],
        url=dc.worker.url,
        block_size=d.block_size,
        request_blocks=d.n,
        matched_blocks=c.matched_blocks,
        cached_blocks=c.matched_blocks,
        prompt_tokens=d.tokens,
        candidates=[
            CandidateOut(
                x.key[0],
                x.key[1],
                x.healthy,
                x.matched_blocks,
                _breakdown(x.by_tier, breakdowns),
                x.predicted_blocks,
                x.active_blocks,
                x.inflight_prefill,
                x.shared_active,
                x.shared_prefill,
                x.credited,
                x.cost,
                "approximate" if approximate(x.key) else "events",
            )
            for x in d.candidates
        ],
        route_id=route_id,
        pd=route_legs(pick, state.settings.pd.protocol, _rng) if pick.disaggregated else None,
    )
    data = encode(out)
    state.metrics.route_latency.observe(time.perf_counter() - t0)
    return data, pick_headers(pick, explain=state.settings.scoring.explain)


def _breakdown(by_tier: Mapping[str, int], seen: dict[int, dict[str, int]]) -> dict[str, int]:
    """``tier_breakdown``, once per distinct mapping: the index shares one per match length."""
    out = seen.get(id(by_tier))
    if out is None:
        out = seen[id(by_tier)] = tier_breakdown(by_tier)
    return out


class RouteEndpoint:
    """``POST /route`` as a plain ASGI endpoint, which :class:`router.edge.dispatch.RouterApp` calls ahead
    of FastAPI: the placement API is the router's hot path, and FastAPI's router and exception
    layers cost as much as the answer itself. ``app_state`` is the app's ``state`` (its ``kv``
    is set when the lifespan starts)."""

    def __init__(self, app_state: Any) -> None:
        self.app_state = app_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: Runtime = self.app_state.kv
        s = state.settings
        status, headers = 200, [(b"content-type", b"application/json")]
        try:
            if s.api_keys:
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                authorize(state, auth.decode("latin-1"), "/route")
            body = await read_body(
                Request(scope, receive), s.proxy.max_body_bytes, s.server.body_timeout_s
            )
            answer, picked = await route_answer(state, body)
            headers += [(k.encode(), v.encode()) for k, v in picked]
        except ClientDisconnect:
            return
        except RouterError as e:
            status, answer = e.status, error_json(e.message, e.type, e.param)
            state.metrics.rejected.labels(str(status)).inc()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, (b"content-length", str(len(answer)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer})
