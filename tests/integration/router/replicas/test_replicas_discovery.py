"""Peers from the router's own pods (``replicas.discovery``), through lightkube against
``router_fakeapi`` (the seam fake of the Kubernetes API server the worker discovery tests use):
every running router pod is a sync peer, every ready one but this replica's own pod a
warm-start source; a pod deleted stops being a peer."""

from __future__ import annotations

import asyncio
import socket

from router_fakeapi import FakeApiServer, make_pod
from router_fakeworker import wait_for

from router.fleet.peers import RouterPods
from router.runtime.replicas import warm_urls
from router.runtime.replicas.peers import follow_peers
from router.settings import load_settings

LABELS = {"app": "kvrouter"}


async def test_router_pods_are_peers_and_warm_start_sources() -> None:
    api = await FakeApiServer().start()
    task = None
    try:
        api.put(make_pod("router-0", ip="10.0.0.1", labels=LABELS))
        api.put(make_pod("router-1", ip="10.0.0.2", labels=LABELS, ready=False))
        api.put(make_pod(socket.gethostname(), ip="10.0.0.3", labels=LABELS))  # this replica
        api.put(make_pod("worker-0", ip="10.0.0.9"))  # another app's labels
        settings = load_settings(
            environ={},
            overrides={
                "port": 8123,
                "replicas": {
                    "sync_bind": "tcp://0.0.0.0:5600",
                    "trusted_network": True,
                    "discovery": {
                        "enabled": True,
                        "api_server": api.url,
                        "namespace": "kv",
                        "labels": LABELS,
                        "interval_s": 0.05,
                    },
                },
            },
        )
        # warm start: the ready router pods but this one
        assert await warm_urls(settings) == ["http://10.0.0.1:8123"]
        # sync: every running router pod (this one's own messages are told by their origin)
        seen: list[set[str]] = []
        pods = RouterPods(settings.replicas.discovery)
        task = asyncio.create_task(follow_peers(pods, 5600, lambda eps: seen.append(set(eps))))
        want = {"tcp://10.0.0.1:5600", "tcp://10.0.0.2:5600", "tcp://10.0.0.3:5600"}
        await wait_for(lambda: seen and seen[-1] == want, 20, "the router pods as peers")
        api.delete("router-0")
        await wait_for(lambda: "tcp://10.0.0.1:5600" not in seen[-1], 20, "router-0 gone")
        assert seen[-1] == want - {"tcp://10.0.0.1:5600"}
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await api.aclose()


async def test_an_unreachable_api_server_leaves_the_configured_peers() -> None:
    settings = load_settings(
        environ={},
        overrides={
            "replicas": {
                "sync_bind": "tcp://0.0.0.0:5600",
                "warm_from": ["http://peer:8000"],
                "trusted_network": True,
                "discovery": {"enabled": True, "api_server": "http://127.0.0.1:9", "timeout_s": 1},
            },
        },
    )
    assert await warm_urls(settings) == ["http://peer:8000"]
