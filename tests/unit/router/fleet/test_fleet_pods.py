"""``router.fleet.pods``: which pods are ready, and the worker a pod stands for
(annotations, defaults, vLLM's ``/kv_event_sources`` answer), with every bad input refused by
name."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from aiohttp import web
from lightkube.resources.core_v1 import Pod

from router.fleet.pods import (
    EventSource,
    NoEventSource,
    PodNotUsable,
    fetch_sources,
    pod_ready,
    sources_to_endpoints,
    worker_for_pod,
)
from router.fleet.upstream import UpstreamPool
from router.settings import DiscoverySettings

S = DiscoverySettings(enabled=True)


def pod(
    *,
    ip: str = "10.0.0.7",
    ready: str = "True",
    phase: str = "Running",
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
) -> Any:
    meta: dict[str, Any] = {"name": "w-0", "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    d = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "c"}]},
        "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
    }
    return msgspec.json.decode(json.dumps(d).encode(), type=Pod)


def src(rank: int, ep: str, replay: str | None = None) -> EventSource:
    return EventSource(endpoint=ep, data_parallel_rank=rank, replay_endpoint=replay)


def test_ready_means_running_ready_addressed_and_not_terminating() -> None:
    assert pod_ready(pod())
    assert not pod_ready(pod(ready="False"))
    assert not pod_ready(pod(phase="Pending"))
    assert not pod_ready(pod(ip=""))
    assert not pod_ready(pod(deleting=True))


def test_defaults_and_annotations() -> None:
    w = worker_for_pod(pod(), S)
    assert (w.id, w.url) == ("w-0", "http://10.0.0.7:8000")
    assert (w.events_endpoint, w.replay_endpoint) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    ann = {
        "kvrouter.io/http-port": "30000",
        "kvrouter.io/events-port": "6000",
        "kvrouter.io/replay-port": "none",
        "kvrouter.io/dp-ranks": "4",
        "kvrouter.io/model": "m",
        "kvrouter.io/pool": "redis",
    }
    w = worker_for_pod(pod(annotations=ann), S)
    assert w.url == "http://10.0.0.7:30000" and w.events_endpoint == "tcp://10.0.0.7:6000"
    assert (w.replay_endpoint, w.dp_ranks, w.model, w.pool) == (None, 4, "m", "redis")
    no_replay = DiscoverySettings(enabled=True, replay_port=None)
    assert worker_for_pod(pod(), no_replay).replay_endpoint is None


def test_ipv6_pod_addresses_are_bracketed() -> None:
    w = worker_for_pod(pod(ip="fd00::7"), S)
    assert w.url == "http://[fd00::7]:8000" and w.events_endpoint == "tcp://[fd00::7]:5557"


@pytest.mark.parametrize(
    ("ann", "named"),
    [
        ({"kvrouter.io/http-port": "http"}, "kvrouter.io/http-port"),
        ({"kvrouter.io/events-port": "70000"}, "kvrouter.io/events-port"),
        ({"kvrouter.io/replay-port": "-1"}, "kvrouter.io/replay-port"),
        ({"kvrouter.io/dp-ranks": "two"}, "kvrouter.io/dp-ranks"),
        ({"kvrouter.io/dp-ranks": "0"}, "dp_ranks"),
    ],
)
def test_bad_annotations_are_refused_by_name(ann: dict[str, str], named: str) -> None:
    with pytest.raises(PodNotUsable, match=named):
        worker_for_pod(pod(annotations=ann), S)


def test_kv_event_sources_wildcards_take_the_pod_ip_and_ranks_count() -> None:
    sources = [
        src(1, "tcp://*:5558", "tcp://0.0.0.0:6001"),
        src(0, "tcp://*:5557", "tcp://0.0.0.0:6000"),
    ]
    w = worker_for_pod(pod(), S, sources)
    assert w.events_endpoint == "tcp://10.0.0.7:5557" and w.replay_endpoint == "tcp://10.0.0.7:6000"
    assert w.dp_ranks == 2
    w = worker_for_pod(pod(), S, [src(0, "tcp://10.9.9.9:7000")])
    assert (w.events_endpoint, w.replay_endpoint) == ("tcp://10.9.9.9:7000", None)


def test_a_pod_without_events_is_an_approximate_worker() -> None:
    """No source listed, or the annotation ``events-port: none``: the worker publishes no KV
    events and joins approximate (issue 36), its replay port ignored."""
    for w in (
        worker_for_pod(pod(annotations={"kvrouter.io/dp-ranks": "2"}), S, []),
        worker_for_pod(pod(annotations={"kvrouter.io/events-port": "None"}), S),
    ):
        assert (w.events_endpoint, w.replay_endpoint, w.approximate) == ("none", None, True)
    assert worker_for_pod(pod(annotations={"kvrouter.io/dp-ranks": "2"}), S, []).dp_ranks == 2
    with pytest.raises(NoEventSource, match="no source"):
        sources_to_endpoints([], "10.0.0.7")


@pytest.mark.parametrize(
    ("sources", "why"),
    [
        ([src(0, "tcp://*:5557"), src(2, "tcp://*:5559")], "0..n-1"),
        ([src(0, "tcp://*:5557"), src(1, "tcp://*:5600")], "port base \\+ r"),
        ([src(0, "tcp://*:5557", "tcp://*:6000"), src(1, "tcp://*:5558")], "some ranks only"),
        ([src(0, "ipc:///tmp/kv")], "not tcp://host:port"),
        ([src(0, "tcp://*:port")], "not tcp://host:port"),
    ],
)
def test_unusable_kv_event_sources_are_refused(sources: list[EventSource], why: str) -> None:
    with pytest.raises(PodNotUsable, match=why):
        worker_for_pod(pod(), S, sources)


def test_discovery_settings_are_checked_by_key() -> None:
    from router.errors import ConfigError
    from router.settings import load_settings

    def bad(disc: dict[str, Any]) -> str:
        with pytest.raises(ConfigError) as e:
            load_settings(environ={}, overrides={"kubernetes": {"discovery": disc}})
        return str(e.value)

    assert "kubernetes.discovery.labels" in bad({"labels": {}})
    assert "kubernetes.discovery.labels.bad key" in bad({"labels": {"bad key": "x"}})
    assert "kubernetes.discovery.endpoints" in bad({"endpoints": "dns"})
    assert "kubernetes.discovery.http_port" in bad({"http_port": 0})
    assert "kubernetes.discovery.api_server" in bad({"api_server": "file:///etc/passwd"})
    assert "kubernetes.discovery.enabled" in bad({"enabled": "yes please"})


def test_no_kubernetes_api_access_fails_the_start_by_name(tmp_path, monkeypatch) -> None:
    """Discovery on, outside a pod, no kubeconfig: ``create_app`` refuses (``kvrouter serve``
    prints it and exits 2) rather than a router that silently never finds a worker."""
    from router.edge.app import create_app
    from router.errors import ConfigError
    from router.settings import load_settings

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    settings = load_settings(environ={}, overrides={"kubernetes": {"discovery": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"kubernetes\.discovery: no Kubernetes API access"):
        create_app(settings)


async def test_kv_event_sources_that_are_not_utf8_make_the_pod_unusable() -> None:
    """Issue 37, 1 (the same hole as replica sync's): msgspec before 0.23 reports a JSON string
    that is not UTF-8 as ``UnicodeDecodeError`` (0.23 as ``DecodeError``); a worker answering one
    is refused, nothing else breaks."""

    async def sources(request: web.Request) -> web.Response:
        return web.Response(body=b'[{"endpoint": "tcp://\xff"}]', content_type="application/json")

    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    pool = UpstreamPool(connect_s=2, read_s=2, write_s=2)
    try:
        with pytest.raises(PodNotUsable, match="not a list of KV event sources"):
            await fetch_sources(pool, f"http://127.0.0.1:{port}", 2.0)
    finally:
        await pool.aclose()
        await runner.cleanup()
