"""Worker roles over real sockets (issue 34, item 2): ``POST /workers`` takes a worker's role and
SGLang bootstrap port and ``GET /workers`` shows them; ``/ready`` needs a routable decode worker,
and in a fleet of prefill and decode workers only (no ``both``) a routable prefill worker too; a
prefill worker registered at run time takes the prefill leg of the next request."""

from __future__ import annotations

import httpx
from router_fakeworker import wait_for


def err(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text)
    return resp.json()["error"]["message"]  # type: ignore[no-any-return]


async def ready(http: httpx.AsyncClient, url: str) -> tuple[int, list[str]]:
    resp = await http.get(url + "/ready")
    return resp.status_code, resp.json()["waiting_for"]


async def test_workers_api_takes_and_shows_roles(workers, router, http):
    a, p, d = await workers("a"), await workers("p"), await workers("d")
    r = await router([a])
    u = r.url
    (listed,) = (await http.get(u + "/workers")).json()["workers"]
    assert (listed["role"], listed["bootstrap_port"]) == ("both", None)

    resp = await http.post(u + "/workers", json=p.spec(role="prefill", bootstrap_port=8998))
    assert resp.status_code == 201, resp.text
    assert (resp.json()["role"], resp.json()["bootstrap_port"]) == ("prefill", 8998)
    resp = await http.post(u + "/workers", json=d.spec(role="decode"))
    assert resp.status_code == 201 and resp.json()["role"] == "decode"
    listed = (await http.get(u + "/workers")).json()["workers"]
    got = {w["id"]: (w["role"], w["bootstrap_port"]) for w in listed}
    assert got == {"a": ("both", None), "p": ("prefill", 8998), "d": ("decode", None)}
    assert r.state.registry.workers["p"].config.bootstrap_port == 8998

    # refused by name, nothing registered
    b = await workers("b")
    assert "role" in err(await http.post(u + "/workers", json=b.spec(role="encoder")), 400)
    msg = err(await http.post(u + "/workers", json=b.spec(bootstrap_port=70000)), 400)
    assert "bootstrap_port" in msg
    assert "bootstrap_port" in err(
        await http.post(u + "/workers", json=b.spec(bootstrap_port="8998")), 422
    )
    assert "b" not in r.state.registry.workers


async def test_ready_needs_a_routable_decode_worker_and_in_a_split_fleet_a_prefill_one(
    workers, router, http
):
    p = await workers("p")
    d = await workers("d", replay_mode="hold")
    r = await router(
        [],
        workers=[p.spec(role="prefill"), d.spec(role="decode")],
        ready=False,
        subscriber={"replay_timeout_s": 30.0},
    )
    await wait_for(lambda: r.state.subscriber.worker_ready("p"), 20, "p's stream live")
    await wait_for(lambda: d.replay_requests, 20, "d's replay requested")
    # the prefill worker alone is live: no worker to decode on
    assert await ready(http, r.url) == (503, ["d", "a routable decode worker"])
    await d.release_replay()
    await r.wait_ready()
    assert await ready(http, r.url) == (200, [])
    # the prefill worker dies: a fleet with no `both` worker needs one
    await p.stop_http()
    await wait_for(lambda: not r.state.registry.workers["p"].healthy, 20, "p marked down")
    assert await ready(http, r.url) == (503, ["a routable prefill worker"])


async def test_ready_in_fleets_that_need_no_prefill_worker(workers, router, http):
    # a `both` worker stands in for the prefill workers
    p, b = await workers("p"), await workers("b")
    r = await router([], workers=[p.spec(role="prefill"), b.spec()])
    assert await ready(http, r.url) == (200, [])
    await p.stop_http()
    await wait_for(lambda: not r.state.registry.workers["p"].healthy, 20, "p marked down")
    assert await ready(http, r.url) == (200, [])
    await b.stop_http()
    await wait_for(lambda: not r.state.registry.workers["b"].healthy, 20, "b marked down")
    assert await ready(http, r.url) == (503, ["a routable decode worker"])

    # decode workers only: each prefills its own requests
    d = await workers("d")
    r2 = await router([], workers=[d.spec(role="decode")])
    assert await ready(http, r2.url) == (200, [])
    # prefill workers only: nowhere to decode, however healthy
    q = await workers("q")
    r3 = await router([], workers=[q.spec(role="prefill")])
    assert await ready(http, r3.url) == (503, ["a routable decode worker"])


async def test_ready_of_a_fleet_of_both_workers_is_unchanged(workers, router, http):
    a = await workers("a")
    r = await router([a])
    assert await ready(http, r.url) == (200, [])
    await a.stop_http()
    await wait_for(lambda: not r.state.registry.workers["a"].healthy, 20, "a marked down")
    assert await ready(http, r.url) == (503, [])  # no role named: as before roles existed


async def test_a_prefill_worker_added_at_run_time_takes_the_prefill_leg(pd, router, http):
    p = await pd.nixl_prefill("p0")
    d = await pd.nixl_decode("d0")
    r = await router([d], pd={"mode": "always", "protocol": "nixl"})
    body = {"model": "fake-model", "prompt": "You are careful. " * 20, "max_tokens": 4}
    resp = await http.post(r.url + "/v1/completions", json=body)
    assert resp.status_code == 200 and "x-kvrouter-prefill-worker" not in resp.headers
    assert not p.seen  # not registered yet

    resp = await http.post(r.url + "/workers", json=p.spec())  # role: prefill
    assert resp.status_code == 201 and resp.json()["role"] == "prefill"
    await wait_for(lambda: r.state.subscriber.worker_ready("p0"), 20, "p0's stream live")
    resp = await http.post(r.url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrouter-worker"] == "d0"
    assert resp.headers["x-kvrouter-prefill-worker"] == "p0"
    assert [s.outcome for s in p.seen] == ["prefill"]
    assert d.seen[-1].outcome == "served_remote"
    assert await ready(http, r.url) == (200, [])


def test_the_pd_overlay_is_a_fleet_of_prefill_and_decode_workers(tmp_path):
    """``deploy/kubernetes/overlays/pd``, composed as kustomize composes it: its worker pods are
    discovered with the roles of their ``llm-d.ai/role`` label, and its router loads with the
    PD settings (the manifest checks of every overlay are ``tests/integration/deploy``'s)."""
    import sys
    from pathlib import Path

    import yaml

    from router.fleet.discovery import with_role
    from router.fleet.pods import worker_for_pod
    from router.fleet.registry import Registry
    from router.settings import HealthSettings, load_settings

    deploy = Path(__file__).resolve().parents[1] / "deploy"
    sys.path.insert(0, str(deploy))
    try:
        from test_kubernetes_manifests import K8S, _as_ready_pod, compose, find, pod_spec
    finally:
        sys.path.remove(str(deploy))

    objs = compose(K8S / "overlays" / "pd")
    router = find(objs, "Deployment", "kvrouter")
    (c,) = pod_spec(router)["containers"]
    raw = yaml.safe_load(find(objs, "ConfigMap", "kvrouter-config")["data"]["router.yaml"])
    raw.pop("admin_key_file")  # (mounted Secrets: tests/integration/deploy checks them)
    raw["replicas"].pop("peer_key_file")
    raw["replicas"]["trusted_network"] = True
    env = {e["name"]: e["value"] for e in c["env"]}
    settings = load_settings(environ=env, overrides=raw)
    assert (settings.pd.mode, settings.pd.protocol, settings.tokenizer) == (
        "threshold", "nixl", "worker"
    )  # fmt: skip
    assert settings.pd.prefill_timeout_s < 30  # under vLLM's block lease
    disc = settings.kubernetes.discovery

    reg = Registry(HealthSettings())
    roles = {}
    for dep in (find(objs, "Deployment", "vllm-prefill"), find(objs, "Deployment", "vllm-decode")):
        pod = _as_ready_pod(dep)
        assert disc.labels.items() <= pod.metadata.labels.items()
        cfg, warnings = with_role(worker_for_pod(pod, disc), pod)
        assert warnings == []
        roles[dep["metadata"]["name"]] = cfg.role
        reg.add(cfg, dynamic=True)
        # the NIXL side channel: on the pod's IP, on a declared port
        (wc,) = pod_spec(dep)["containers"]
        wenv = {e["name"]: e for e in wc["env"]}
        assert wenv["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        )
        port = int(wenv["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert port in {p["containerPort"] for p in wc["ports"]}
        (flag,) = [a for a in wc["args"] if a.startswith("--kv-transfer-config=")]
        assert '"NixlConnector"' in flag
    assert roles == {"vllm-prefill": "prefill", "vllm-decode": "decode"}
    # a split fleet: ready only with both roles routable
    assert reg.lacking_roles(lambda w: True) == []
    assert reg.lacking_roles(lambda w: not w.startswith("vllm-prefill")) == ["prefill"]
