"""The proxy's execution of a remote pick (docs/architecture.md §10), with the failure contract:
everything here happens before the decode worker's first byte reaches the client.

- sequential protocols (``nixl``, ``shared_storage``), :func:`prefill_first`: the prefill leg
  under ``pd.prefill_timeout_s`` (shorter than the prefill worker's block lease: vLLM's is
  30 s). A 5xx or a transport error tries the next prefill worker, ``pd.prefill_retries``
  times; then, or after a timeout or an answer without ``kv_transfer_params``, the decode
  worker prefills itself (the pick falls back, counted by cause). A 4xx is the client's error:
  the client gets it, and the decode worker never sees the request.
- concurrent protocol (``sglang``), :class:`Sibling`: the prefill leg runs beside the decode
  leg; a prefill leg that fails while the decode worker has not answered cancels the decode
  leg (its connection closes: SGLang aborts the request) and the decode worker prefills itself;
  a prefill 4xx goes to the client. The sibling is cancelled whenever the request ends.

Each leg is a :class:`router.placement.Flight` of its own (the prefill worker's ends with its
answer), so no ticket outlives its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from router.edge.door import Entry
from router.edge.legs import answer_params, apply, bootstrap, decode_patch, prefill_patch
from router.edge.usage import cached_tokens_of
from router.fleet.upstream import ConnectError, UpstreamError
from router.placement import Choice, Flight
from router.runtime import Runtime

__all__ = ["PrefillAnswer", "Sibling", "SiblingFailed", "prefill_first"]

T = TypeVar("T")
log = logging.getLogger("kvrouter.proxy")
_rng = random.SystemRandom()  # bootstrap rooms: unguessable, never repeated by a seed


class PrefillAnswer:
    """A prefill worker's 4xx: the client's own error, answered as the worker gave it."""

    __slots__ = ("content", "content_type", "status", "worker")

    def __init__(self, status: int, content_type: str, content: bytes, worker: Choice) -> None:
        self.status = status
        self.content_type = content_type
        self.content = content
        self.worker = worker


class SiblingFailed(Exception):
    """The concurrent prefill leg failed before the decode worker answered."""

    def __init__(self, cause: str, answer: PrefillAnswer | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.answer = answer


async def _post(
    state: Runtime, url: str, path: str, headers: list[tuple[str, str]], body: bytes
) -> tuple[int, str, bytes]:
    resp = await state.upstream.request(url, "POST", path, headers, body)
    try:
        return resp.status_code, resp.header("content-type") or "", await resp.read()
    finally:
        await resp.aclose()


def _path(entry: Entry) -> str:
    return "/v1/completions" if entry.endpoint == "completions" else "/v1/chat/completions"


def _fly(state: Runtime, entry: Entry, p: Choice, t0: float) -> Flight:
    d = entry.pick.decision
    return state.placer.fly(
        d, p.index, "proxy", endpoint=entry.endpoint or "", t0=t0, leg="prefill"
    )


def _fail(state: Runtime, p: Choice, e: UpstreamError) -> None:
    state.registry.mark_failure(
        p.worker.id, f"proxy (prefill): {e}", now=isinstance(e, ConnectError)
    )


def _answered(state: Runtime, flight: Flight, status: int, content: bytes, t1: float) -> None:
    """The prefill worker answered (its whole answer read): its leg ends, and is timed."""
    flight.first_byte()
    if status == 200:
        flight.cached = cached_tokens_of(content)
    flight.done(str(status))
    state.metrics.pd.leg("prefill", time.perf_counter() - t1)


def _chosen(entry: Entry, p: Choice) -> None:
    """The prefill worker that answered leads the pick's list (its headers name it)."""
    ps = entry.pick.prefills
    if ps and ps[0] is not p:
        ps.remove(p)
        ps.insert(0, p)


async def prefill_first(
    state: Runtime, entry: Entry, headers: list[tuple[str, str]], t0: float
) -> dict[str, Any] | PrefillAnswer | None:
    """The sequential prefill leg: the decode leg's ``kv_transfer_params`` (``{}`` for shared
    storage), a :class:`PrefillAnswer` for the client, or None once the pick fell back."""
    pick, cfg, pdm = entry.pick, state.settings.pd, state.metrics.pd
    body = apply(entry.body, prefill_patch(cfg.protocol))
    cause = "prefill_error"
    for p in pick.prefills[: 1 + cfg.prefill_retries]:
        flight = _fly(state, entry, p, t0)
        t1 = time.perf_counter()
        try:
            status, ctype, content = await asyncio.wait_for(
                _post(state, p.worker.url, _path(entry), headers, body), cfg.prefill_timeout_s
            )
        except asyncio.TimeoutError:
            flight.done("timeout")
            cause = "prefill_timeout"
            break
        except asyncio.CancelledError:
            flight.done("client_disconnect")
            raise
        except UpstreamError as e:
            flight.done("upstream_error")
            _fail(state, p, e)
            continue
        _answered(state, flight, status, content, t1)
        if 400 <= status < 500:
            return PrefillAnswer(status, ctype, content, p)
        if status != 200:
            continue
        _chosen(entry, p)
        if cfg.protocol != "nixl":
            return {}
        params = answer_params(content)
        if params is not None:
            _epoch(state, p, params.get("remote_engine_id"))
            return params
        cause = "prefill_no_params"
        break
    pick.fall_back(cause)
    pdm.fell_back(cause)
    return None


def _epoch(state: Runtime, p: Choice, engine_id: object) -> None:
    """A prefill worker whose engine id changed restarted between two answers: a new epoch
    (vllm#49238: a decode worker holding the old one's handshake can fail)."""
    ws = p.worker
    if isinstance(engine_id, str) and state.placer.engine_seen(ws.id, engine_id, ws.keys):
        log.warning("prefill worker %s restarted (engine id now %s)", ws.id, engine_id)
        state.metrics.pd.restarted()


class Sibling:
    """SGLang's prefill leg, sent beside the decode leg with the same bootstrap fields."""

    def __init__(self, state: Runtime, entry: Entry, headers: list[tuple[str, str]], t0: float):
        p = entry.pick.prefill
        assert p is not None
        self.state = state
        fields = bootstrap(p, _rng)
        self.decode_body = apply(entry.body, decode_patch("sglang", fields))
        body = apply(entry.body, prefill_patch("sglang", fields))
        self.flight = _fly(state, entry, p, t0)
        self.task = asyncio.ensure_future(self._run(p, _path(entry), headers, body))

    async def _run(
        self, p: Choice, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> SiblingFailed | None:
        state, flight, t1 = self.state, self.flight, time.perf_counter()
        try:
            status, ctype, content = await asyncio.wait_for(
                _post(state, p.worker.url, path, headers, body),
                state.settings.pd.prefill_timeout_s,
            )
        except asyncio.TimeoutError:
            flight.done("timeout")
            return SiblingFailed("prefill_timeout")
        except asyncio.CancelledError:
            flight.done("cancelled")
            raise
        except UpstreamError as e:
            flight.done("upstream_error")
            _fail(state, p, e)
            return SiblingFailed("prefill_error")
        _answered(state, flight, status, content, t1)
        if 400 <= status < 500:
            return SiblingFailed("prefill_refused", PrefillAnswer(status, ctype, content, p))
        return None if status == 200 else SiblingFailed("prefill_error")

    async def race(self, decode: Awaitable[T]) -> T:
        """The decode leg's exchange, unless the prefill leg fails first: then the decode leg
        is cancelled and :class:`SiblingFailed` raised."""
        d_task = asyncio.ensure_future(decode)
        try:
            done, _ = await asyncio.wait({self.task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if d_task not in done:
                failed = self.task.result()
                if failed is not None:
                    d_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                        await d_task
                    raise failed
            return await d_task
        except asyncio.CancelledError:
            d_task.cancel()
            self.cancel()
            raise

    def cancel(self) -> None:
        """End the prefill leg if it still runs (its flight ends with it)."""
        if not self.task.done():
            self.task.cancel()
        self.flight.done("cancelled")  # (a task cancelled before it ran never ends it)
