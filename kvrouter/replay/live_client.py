"""Live replay's client: a trace's requests sent to running servers at ``timestamp / speedup``, streamed.

Each request is a streamed ``POST /v1/completions`` (``max_tokens`` = the trace's output length,
``ignore_eos``, ``stream_options.include_usage``): its time to first token is taken at the first
chunk that carries text, its reuse from ``usage.prompt_tokens_details.cached_tokens``. Where a
request goes is the policy's business:

* ``random``, ``round_robin``, ``least_load`` (fewest requests outstanding, ties in turn) are
  decided here, in the client, over the workers' URLs;
* any other policy is a router URL that places every request itself (``kvrouter``, a peer).

One :class:`httpx.AsyncClient` carries every stream; at most ``max_inflight`` are open at once (a
request past that bound waits for a slot, and its lateness is reported). Arrivals are paced on
the event loop's clock; nothing else waits on time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

__all__ = ["CLIENT_POLICIES", "ClientPolicy", "LiveOutcome", "LiveRequest", "drive", "model_of"]

CLIENT_POLICIES = ("random", "round_robin", "least_load")


@dataclass(frozen=True)
class LiveRequest:
    """What the driver needs of one trace request: when, what, and how long an answer."""

    arrival_s: float  # trace time, seconds from the trace's start
    prompt: Callable[[], str]  # built at send time: a whole trace's prompts need not fit in memory
    max_tokens: int


@dataclass
class LiveOutcome:
    """One request as the client saw it (times in wall-clock seconds)."""

    index: int
    late_s: float = 0.0  # sent this long after its scheduled arrival
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str | None = None
    #: a PD fleet's decision as the router answered it (``x-kvrouter-pd``: local, remote) and
    #: the prefill worker of a remote one (``x-kvrouter-prefill-worker``)
    pd: str | None = None
    prefill_worker: str | None = None
    error: str | None = None


class ClientPolicy:
    """Picks a worker URL per request on the client; tracks requests outstanding per worker."""

    def __init__(self, name: str, urls: Sequence[str], seed: int = 0) -> None:
        if name not in CLIENT_POLICIES:
            raise ValueError(f"unknown client-side policy {name!r} (known: {CLIENT_POLICIES})")
        if not urls:
            raise ValueError("a client-side policy needs at least one worker URL")
        self.name, self.urls = name, list(urls)
        self.outstanding = [0] * len(urls)
        self._rng = random.Random(seed)
        self._next = 0

    def pick(self) -> int:
        n = len(self.urls)
        if self.name == "random":
            return self._rng.randrange(n)
        start = self._next
        self._next = (self._next + 1) % n
        if self.name == "round_robin":
            return start
        # least_load: fewest outstanding; ties go to the first from a rotating start
        return min(((start + k) % n for k in range(n)), key=lambda i: self.outstanding[i])


async def model_of(client: httpx.AsyncClient, base: str) -> str:
    """The first model a server lists (sglang-router needs ``model`` in every body)."""
    r = await client.get(base.rstrip("/") + "/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base}/v1/models lists no model")
    return str(data[0]["id"])


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    req: LiveRequest,
    out: LiveOutcome,
) -> None:
    body = {
        "model": model,
        "prompt": req.prompt(),
        "max_tokens": max(1, req.max_tokens),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out.worker = r.headers.get("x-kvrouter-worker", out.worker)
            out.pd = r.headers.get("x-kvrouter-pd")
            out.prefill_worker = r.headers.get("x-kvrouter-prefill-worker")
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                out.error = f"HTTP {r.status_code}: {text[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if out.ttft_s is not None and '"usage"' not in line:
                    continue  # only the first text and the usage are read
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if out.ttft_s is None and choices and choices[0].get("text"):
                    out.ttft_s = time.perf_counter() - start
                use = chunk.get("usage")
                if use:
                    out.prompt_tokens = int(use.get("prompt_tokens") or 0)
                    out.output_tokens = int(use.get("completion_tokens") or 0)
                    details = use.get("prompt_tokens_details") or {}
                    out.cached_tokens = int(details.get("cached_tokens") or 0)
        out.e2e_s = time.perf_counter() - start
        if not out.prompt_tokens:
            out.error = "no usage in the stream"
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"


async def drive(
    requests: Sequence[LiveRequest],
    *,
    speedup: float,
    model: str,
    router: str | None = None,
    policy: ClientPolicy | None = None,
    max_inflight: int = 2048,
    timeout_s: float = 600.0,
    on_done: Callable[[LiveOutcome], None] | None = None,
) -> list[LiveOutcome]:
    """Send ``requests`` at their arrival times / ``speedup``, to ``router`` or by ``policy``."""
    if (router is None) == (policy is None):
        raise ValueError("give a router URL or a client-side policy, not both")
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    outcomes = [LiveOutcome(i) for i in range(len(requests))]
    slots = asyncio.Semaphore(max_inflight)
    # idle connections are dropped well before a server's keep-alive timeout (kvrouter's and
    # uvicorn's default: 5 s, httpx's own: 5 s too): at equal timeouts a request can be written on
    # a connection the server is closing, and a POST that lost that race is not retried (ReadError)
    limits = httpx.Limits(
        max_connections=max_inflight, max_keepalive_connections=max_inflight, keepalive_expiry=2.0
    )
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    loop = asyncio.get_running_loop()

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def send(i: int, due: float) -> None:
            out = outcomes[i]
            async with slots:
                out.late_s = max(0.0, loop.time() - due)
                if policy is not None:
                    w = policy.pick()
                    policy.outstanding[w] += 1
                    out.worker = policy.urls[w]
                    try:
                        await _one(client, policy.urls[w], model, requests[i], out)
                    finally:
                        policy.outstanding[w] -= 1
                else:
                    assert router is not None
                    await _one(client, router.rstrip("/"), model, requests[i], out)
            if on_done is not None:
                on_done(out)

        t0 = loop.time() - (requests[0].arrival_s / speedup if requests else 0.0)
        tasks = []
        for i, req in enumerate(requests):
            due = t0 + req.arrival_s / speedup
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing arrivals, not waiting for state
            tasks.append(asyncio.create_task(send(i, due)))
        await asyncio.gather(*tasks)
    return outcomes
