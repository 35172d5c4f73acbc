"""Kubernetes worker discovery, end to end in one router: the router app (real uvicorn on
127.0.0.1) lists and watches pods through lightkube against :mod:`router_fakeapi` — a seam fake of
the Kubernetes API server (no real one can run here) speaking the real LIST/WATCH JSON — and keeps
one worker per ready pod. Pods point at real :class:`FakeWorker` processes-in-loop (HTTP + ZMQ), so
a discovered worker is subscribed to and routed to for real."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from router_fakeapi import FakeApiServer, make_pod
from router_fakeworker import FakeWorker, ServerHandle, wait_for
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.edge.app import create_app
from router.runtime import Runtime
from router.settings import load_settings


def annotations(w: FakeWorker, **extra: str) -> dict[str, str]:
    """The kvrouter.io/* annotations that point a pod at ``w``'s ports."""
    port = lambda ep: ep.rsplit(":", 1)[1]  # noqa: E731
    d = {
        "kvrouter.io/http-port": w.url.rsplit(":", 1)[1],
        "kvrouter.io/events-port": port(w.events_endpoint),
        "kvrouter.io/replay-port": port(w.replay_endpoint),
    }
    d.update({f"kvrouter.io/{k.replace('_', '-')}": v for k, v in extra.items()})
    return d


@pytest.fixture
async def api() -> AsyncIterator[Callable[..., Awaitable[FakeApiServer]]]:
    made: list[FakeApiServer] = []

    async def make(**kw: Any) -> FakeApiServer:
        s = await FakeApiServer(**kw).start()
        made.append(s)
        return s

    yield make
    for s in made:
        await s.aclose()


@pytest.fixture
async def discovering() -> AsyncIterator[Callable[..., Awaitable[Runtime]]]:
    """A router whose only workers come from discovery against ``api``."""
    servers: list[ServerHandle] = []

    async def make(api: FakeApiServer, **discovery: Any) -> Runtime:
        disc = {
            "enabled": True,
            "api_server": api.url,
            "namespace": "kv",
            "labels": {"app": "vllm"},
            "retry_s": 0.05,
        }
        disc.update(discovery)
        settings = load_settings(
            environ={},
            overrides={"health": {"interval_s": 0.2}, "kubernetes": {"discovery": disc}},
        )
        app = create_app(settings)
        servers.append(await ServerHandle(app, router=True).start())
        return app.state.kv  # type: ignore[no-any-return]

    yield make
    for s in servers:
        await s.stop()


def ids(state: Runtime) -> set[str]:
    return set(state.registry.workers)


async def test_ready_pods_become_workers_and_leave_when_unready_or_deleted(
    api, discovering, workers
):
    a, b = await workers("a"), await workers("b")
    fake = await api()
    fake.put(make_pod("pod-a", annotations=annotations(a, model="m1", pool="p", dp_ranks="1")))
    fake.put(make_pod("pod-b", ready=False, annotations=annotations(b)))
    fake.put(make_pod("other", labels={"app": "not-vllm"}, annotations=annotations(b)))
    fake.put(make_pod("bad-port", annotations={"kvrouter.io/events-port": "http"}))
    state = await discovering(fake)

    await wait_for(lambda: ids(state) == {"pod-a"}, 10, "pod-a discovered")
    assert fake.lists[0]["labelSelector"] == "app=vllm"
    cfg = state.registry.workers["pod-a"].config
    assert cfg.url == a.url and cfg.events_endpoint == a.events_endpoint
    assert cfg.replay_endpoint == a.replay_endpoint
    assert (cfg.model, cfg.pool, cfg.dp_ranks) == ("m1", "p", 1)
    assert state.registry.workers["pod-a"].dynamic
    # subscribed for real: an event published by the pod's worker reaches the index
    tokens = list(b"discovered worker " * 4)
    a.store(tokens)
    await wait_for(
        lambda: (
            state.index.match(state.index.request_hashes(tokens, model="m1"))
            .workers[("pod-a", 0)]
            .matched_blocks
            == len(tokens) // 16
        ),
        10,
        "pod-a's events indexed",
    )

    fake.put(make_pod("pod-b", annotations=annotations(b)))  # becomes ready
    await wait_for(lambda: ids(state) == {"pod-a", "pod-b"}, 10, "pod-b added when ready")
    fake.put(make_pod("pod-a", ready=False, annotations=annotations(a)))
    await wait_for(lambda: ids(state) == {"pod-b"}, 10, "pod-a removed when not ready")
    assert ("pod-a", 0) not in set(state.index.workers())
    fake.delete("pod-b")
    await wait_for(lambda: ids(state) == set(), 10, "pod-b removed when deleted")
    assert len(fake.lists) == 1, "a healthy watch never relists"


async def test_a_pod_being_deleted_or_changing_address_is_replaced(api, discovering, workers):
    a, b = await workers("a"), await workers("b")
    fake = await api()
    fake.put(make_pod("pod-a", annotations=annotations(a)))
    state = await discovering(fake)
    await wait_for(lambda: ids(state) == {"pod-a"}, 10, "pod-a discovered")
    moved = make_pod("pod-a", annotations=annotations(b))  # same pod name, other ports
    fake.put(moved)
    await wait_for(
        lambda: (
            "pod-a" in state.registry.workers
            and state.registry.workers["pod-a"].config.url == b.url
        ),
        10,
        "pod-a re-registered at its new address",
    )
    terminating = make_pod("pod-a", annotations=annotations(b))
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    fake.put(terminating)
    await wait_for(lambda: ids(state) == set(), 10, "a terminating pod stops being a worker")


@pytest.mark.parametrize("abrupt", [False, True], ids=["stream-ends", "connection-reset"])
async def test_a_dropped_watch_resumes_from_the_last_version(api, discovering, workers, abrupt):
    a, b = await workers("a"), await workers("b")
    fake = await api()
    fake.put(make_pod("pod-a", annotations=annotations(a)))
    state = await discovering(fake)
    await wait_for(lambda: ids(state) == {"pod-a"} and fake.open_watches == 1, 10, "watching")
    last = fake.put(make_pod("pod-a", annotations=annotations(a, model="m2")))
    await wait_for(
        lambda: (
            state.registry.workers.get("pod-a") is not None
            and state.registry.workers["pod-a"].config.model == "m2"
        ),
        10,
        "the modification applied",
    )
    watches = len(fake.watches)
    fake.drop_watches(abrupt=abrupt)
    await wait_for(lambda: len(fake.watches) > watches and fake.open_watches == 1, 10, "rewatch")
    assert fake.watches[-1]["resourceVersion"] == str(last), "resumed, not restarted"
    fake.put(make_pod("pod-b", annotations=annotations(b)))
    await wait_for(lambda: ids(state) == {"pod-a", "pod-b"}, 10, "an event after the reconnect")
    assert len(fake.lists) == 1 and fake.expired == 0


@pytest.mark.parametrize("expired_as", ["event", "status"])
async def test_an_expired_version_relists_and_drops_pods_deleted_meanwhile(
    api, discovering, workers, expired_as
):
    """410 Gone — as an ERROR event in the watch stream, or as the watch's HTTP status: the
    events in between are lost for good, so discovery LISTs again and reconciles everything."""
    a, b, c = await workers("a"), await workers("b"), await workers("c")
    fake = await api(expired_as=expired_as)
    fake.put(make_pod("pod-a", annotations=annotations(a)))
    fake.put(make_pod("pod-b", annotations=annotations(b)))
    state = await discovering(fake)
    await wait_for(lambda: ids(state) == {"pod-a", "pod-b"} and fake.open_watches == 1, 10, "up")

    fake.watch_status = 503  # no watch for a while: the changes below are never streamed
    fake.drop_watches(abrupt=True)
    refused = len(fake.watches)
    await wait_for(lambda: len(fake.watches) >= refused + 2, 10, "watch retried while refused")
    fake.delete("pod-b")
    fake.put(make_pod("pod-c", annotations=annotations(c)))
    fake.compact()
    fake.watch_status = None

    await wait_for(lambda: ids(state) == {"pod-a", "pod-c"}, 10, "reconciled by a relist")
    assert fake.expired >= 1 and len(fake.lists) == 2
    await wait_for(lambda: fake.open_watches == 1, 10, "watching again")
    assert int(fake.watches[-1]["resourceVersion"]) >= fake.oldest, "watches from the new list"


async def test_the_api_server_down_at_start_is_retried(api, discovering, workers):
    a = await workers("a")
    fake = await api()
    url = fake.url
    await fake.http.stop()  # type: ignore[union-attr]
    state = await discovering(fake, api_server=url)
    assert ids(state) == set()
    restarted = FakeApiServer()
    restarted.put(make_pod("pod-a", annotations=annotations(a)))
    port = int(url.rsplit(":", 1)[1])
    restarted.http = await ServerHandle(restarted.app, port=port).start()
    try:
        await wait_for(lambda: ids(state) == {"pod-a"}, 15, "discovered once the API is back")
    finally:
        await restarted.aclose()


async def test_kv_event_sources_give_the_endpoints_and_ranks(api, discovering, workers):
    """``endpoints: kv_event_sources``: the event endpoints (one per data-parallel rank) come
    from the pod's ``GET /kv_event_sources``, vLLM's answer shape; a pod whose answer is not
    usable yet is retried until it is."""
    a = await workers("a")
    ev_port = int(a.events_endpoint.rsplit(":", 1)[1])
    rp_port = int(a.replay_endpoint.rsplit(":", 1)[1])
    answer: dict[str, Any] = {"status": 503, "body": {"error": "engine starting"}}

    async def sources(request: Request) -> Response:
        if answer["status"] != 200:
            answer["reads"] = answer.get("reads", 0) + 1
        return JSONResponse(answer["body"], answer["status"])

    vllm = await ServerHandle(Starlette(routes=[Route("/kv_event_sources", sources)])).start()
    try:
        fake = await api()
        http_port = vllm.url.rsplit(":", 1)[1]
        fake.put(make_pod("vllm-0", annotations={"kvrouter.io/http-port": http_port}))
        state = await discovering(fake, endpoints="kv_event_sources")
        await wait_for(lambda: len(fake.watches) >= 1, 10, "watching")
        assert ids(state) == set(), "not a worker while its sources are unreadable"
        answer["status"], answer["body"] = 200, [
            {"data_parallel_rank": 1, "endpoint": f"tcp://*:{ev_port + 1}",
             "replay_endpoint": f"tcp://*:{rp_port + 1}", "topic": ""},
            {"data_parallel_rank": 0, "endpoint": f"tcp://*:{ev_port}",
             "replay_endpoint": f"tcp://*:{rp_port}", "topic": ""},
        ]  # fmt: skip
        await wait_for(lambda: ids(state) == {"vllm-0"}, 10, "added by the retry")
        cfg = state.registry.workers["vllm-0"].config
        assert cfg.dp_ranks == 2
        assert cfg.events_endpoint == f"tcp://127.0.0.1:{ev_port}"
        assert cfg.replay_endpoint == f"tcp://127.0.0.1:{rp_port}"
        assert cfg.url == vllm.url
        # a failed read of a registered pod keeps its worker; only readiness removes it
        answer["status"], answer["body"], answer["reads"] = 503, {"error": "busy"}, 0
        reads = len(fake.watches)
        fake.put(make_pod("vllm-0", annotations={"kvrouter.io/http-port": http_port, "x": "1"}))
        await wait_for(lambda: answer.get("reads", 0) >= 2, 10, "the pod read again")
        assert ids(state) == {"vllm-0"} and len(fake.watches) == reads
        fake.put(make_pod("vllm-0", ready=False, annotations={"kvrouter.io/http-port": http_port}))
        await wait_for(lambda: ids(state) == set(), 10, "removed once not ready")
    finally:
        await vllm.stop()


async def test_hostile_kv_event_sources_delay_no_other_pod_and_are_refused(
    api, discovering, workers, caplog
):
    """One pod never answers ``/kv_event_sources``, one streams an endless answer: the good pod
    is added at once, the endless answer is cut at 64 KiB and refused, the silent one times out;
    neither becomes a worker."""
    a = await workers("a")
    ev = int(a.events_endpoint.rsplit(":", 1)[1])
    never = asyncio.Event()

    async def silent(request: Request) -> Response:
        await never.wait()
        return JSONResponse([])

    async def endless(request: Request) -> Response:
        async def body():
            yield b"["
            while True:
                yield b'{"data_parallel_rank": 0, "endpoint": "tcp://*:1"},' * 1000
                await asyncio.sleep(0)

        return StreamingResponse(body(), media_type="application/json")

    async def good(request: Request) -> Response:
        return JSONResponse([{"data_parallel_rank": 0, "endpoint": f"tcp://*:{ev}"}])

    servers = [
        await ServerHandle(Starlette(routes=[Route("/kv_event_sources", f)])).start()
        for f in (silent, endless, good)
    ]
    try:
        fake = await api()
        for name, srv in zip(("silent", "endless", "good"), servers):
            port = srv.url.rsplit(":", 1)[1]
            fake.put(make_pod(name, annotations={"kvrouter.io/http-port": port}))
        state = await discovering(fake, endpoints="kv_event_sources", timeout_s=2.0)
        await wait_for(lambda: ids(state) == {"good"}, 1.5, "the good pod, before any timeout")
        caplog.set_level(logging.WARNING, logger="kvrouter.discovery")

        def refused(pod: str, why: str) -> bool:
            return any(
                f"pod {pod} is not a worker" in r.getMessage() and why in r.getMessage()
                for r in caplog.records
            )

        await wait_for(lambda: refused("endless", "larger than 64 KiB"), 10, "endless refused")
        await wait_for(lambda: refused("silent", "Timeout"), 10, "silent timed out")
        assert ids(state) == {"good"}
        cfg = state.registry.workers["good"].config
        assert cfg.events_endpoint == f"tcp://127.0.0.1:{ev}" and cfg.replay_endpoint is None
    finally:
        never.set()
        for srv in servers:
            await srv.stop()
