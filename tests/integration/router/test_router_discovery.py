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

import httpx
import pytest
from router_fakeapi import FakeApiServer, make_pod
from router_fakeworker import FakeWorker, ServerHandle, wait_for
from router_pdworker import PdFleet
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

    async def make(
        api: FakeApiServer, *, settings: dict[str, Any] | None = None, **discovery: Any
    ) -> Runtime:
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
            overrides={
                "health": {"interval_s": 0.2},
                "kubernetes": {"discovery": disc},
                **(settings or {}),
            },
        )
        app = create_app(settings)
        servers.append(await ServerHandle(app, router=True).start())
        ROUTER_URLS[id(app.state.kv)] = servers[-1].url
        return app.state.kv  # type: ignore[no-any-return]

    yield make
    for s in servers:
        await s.stop()
    ROUTER_URLS.clear()


#: id(Runtime) -> the URL its router serves on (made by ``discovering``)
ROUTER_URLS: dict[int, str] = {}


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


def role_pod(name: str, w: FakeWorker, role: str | None, **ann: str) -> dict[str, Any]:
    """A pod of ``w`` labelled ``llm-d.ai/role: role`` (no label: None), extra annotations."""
    labels = {"app": "vllm"} if role is None else {"app": "vllm", "llm-d.ai/role": role}
    return make_pod(name, labels=labels, annotations={**annotations(w), **ann})


async def test_pod_roles_from_llm_d_labels_and_bootstrap_ports_from_annotations(
    api, discovering, workers, caplog
):
    """``llm-d.ai/role`` as llm-d reads it, the SGLang bootstrap port from its annotation; an
    unknown role is ``both`` and a malformed port none, each warned about once per pod; an
    encoder pod is no worker; a pod whose label changes is re-registered with its new role."""
    caplog.set_level(logging.WARNING, logger="kvrouter.discovery")
    ws = [await workers(f"w{i}") for i in range(7)]
    fake = await api()
    sg = "sglang.ai/bootstrap-port"
    fake.put(role_pod("pre", ws[0], "prefill", **{sg: "8998"}))
    fake.put(role_pod("dec", ws[1], "decode"))
    fake.put(role_pod("agg", ws[2], "prefill-decode"))
    fake.put(role_pod("plain", ws[3], None, **{"vllm.ai/bootstrap-port": "9000"}))
    fake.put(role_pod("odd", ws[4], "router"))
    fake.put(role_pod("badport", ws[5], "prefill", **{sg: "eighty"}))
    fake.put(role_pod("enc", ws[6], "encode"))
    state = await discovering(fake)
    want = {"pre", "dec", "agg", "plain", "odd", "badport"}
    await wait_for(lambda: ids(state) == want, 10, "the role pods discovered")

    def of(name: str) -> tuple[str, int | None]:
        cfg = state.registry.workers[name].config
        return cfg.role, cfg.bootstrap_port

    assert {n: of(n) for n in want} == {
        "pre": ("prefill", 8998),
        "dec": ("decode", None),
        "agg": ("both", None),
        "plain": ("both", 9000),
        "odd": ("both", None),
        "badport": ("prefill", None),
    }

    def warned(pod: str, what: str) -> int:
        return sum(
            f"pod {pod}" in r.getMessage() and what in r.getMessage() for r in caplog.records
        )

    await wait_for(lambda: warned("enc", "encode") == 1, 10, "the encoder refused")
    assert warned("odd", "llm-d.ai/role='router'") == 1
    assert warned("badport", "sglang.ai/bootstrap-port='eighty'") == 1
    # the same pod again (a status update): no second warning, the same worker
    before = len(fake.watches)
    fake.put(role_pod("odd", ws[4], "router", other="1"))
    fake.put(role_pod("badport", ws[5], "prefill", **{sg: "eighty"}, other="1"))
    fake.put(role_pod("flip", ws[6], "decode"))  # a marker: once it is in, the others were read
    await wait_for(lambda: "flip" in ids(state), 10, "the marker pod discovered")
    assert len(fake.watches) == before
    assert warned("odd", "llm-d.ai/role") == 1 and warned("badport", "bootstrap-port") == 1
    # a pod's role changes: its worker is registered again with the new one
    fake.put(role_pod("dec", ws[1], "prefill", **{sg: "8999"}))
    await wait_for(lambda: of("dec") == ("prefill", 8999), 10, "dec re-registered as prefill")


async def test_discovered_prefill_and_decode_pods_serve_a_disaggregated_request(
    api, discovering, zctx
):
    """Pods labelled prefill and decode become a PD fleet: a request through the router's
    proxy is prefilled on the prefill pod's worker and decoded on the decode pod's."""
    fleet = PdFleet(zctx)
    try:
        p = await fleet.nixl_prefill("p0")
        d = await fleet.nixl_decode("d0")
        fake = await api()
        fake.put(role_pod("vllm-prefill-0", p, "prefill"))
        fake.put(role_pod("vllm-decode-0", d, "decode"))
        state = await discovering(fake, settings={"pd": {"mode": "always", "protocol": "nixl"}})
        both = {"vllm-prefill-0", "vllm-decode-0"}
        await wait_for(lambda: ids(state) == both and state.all_ready(), 10, "the PD fleet")
        async with httpx.AsyncClient(timeout=15.0, trust_env=False) as http:
            router_url = ROUTER_URLS[id(state)]
            assert (await http.get(router_url + "/ready")).status_code == 200
            body = {"model": "fake-model", "prompt": "You are careful. " * 20, "max_tokens": 4}
            resp = await http.post(router_url + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvrouter-worker"] == "vllm-decode-0"
            assert resp.headers["x-kvrouter-prefill-worker"] == "vllm-prefill-0"
            assert [s.outcome for s in p.seen] == ["prefill"]
            assert [s.outcome for s in d.seen] == ["served_remote"]
            assert resp.json()["choices"][0]["text"] == "tok tok tok tok"
            # the prefill pod goes: a fleet of decode pods only is still ready (local prefill)
            fake.delete("vllm-prefill-0")
            await wait_for(lambda: ids(state) == {"vllm-decode-0"}, 10, "the prefill pod gone")
            assert (await http.get(router_url + "/ready")).status_code == 200
    finally:
        await fleet.aclose()
