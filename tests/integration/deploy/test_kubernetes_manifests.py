"""``deploy/kubernetes/``: every manifest validated against the Kubernetes schemas
(``kubernetes-validate``, which ships them: offline), and each overlay composed the way kustomize
composes it (resources, directories, namespace, patches by kind and name, images; the CI stage
compares this with kustomize's own render, object for object) and checked against the
code it configures: the router's ConfigMap loads with ``router.settings``, the worker pods carry
the discovery labels and annotations that ``router.fleet.discovery`` turns into workers, and the KV event
flags of vLLM and SGLang publish on the annotated ports. The real kustomize render of the same
overlays runs in the CI stage ``tests/stages/kubernetes`` (it needs a ``kubectl``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml

from router.fleet.pods import pod_ready, worker_for_pod
from router.settings import load_settings

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
KUBE_VERSION = "1.30.0"  # the oldest Kubernetes release the manifests promise to fit


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifest_files() -> list[Path]:
    """Every whole object file; patches are partial objects, checked once composed."""
    patches = {
        (k.parent / p["path"]).resolve()
        for k in K8S.rglob("kustomization.yaml")
        for p in yaml.safe_load(k.read_text()).get("patches", [])
    }
    return sorted(
        p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p not in patches
    )


def strategic_merge(base: Any, patch: Any) -> Any:
    """Enough of kustomize's strategic merge for these patches: maps merge, lists of named
    items (containers, env) merge by name, other lists replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and all("name" in x for x in patch):
        out_list = list(base)
        added = []
        for item in patch:
            i = next((i for i, x in enumerate(out_list) if x.get("name") == item["name"]), None)
            if i is None:
                added.append(item)
            else:
                out_list[i] = strategic_merge(out_list[i], item)
        return added + out_list  # kustomize puts a patch's new items first
    return patch


def compose(directory: Path) -> list[dict[str, Any]]:
    """A kustomization's objects, composed as kustomize does for the fields used here."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
    assert not unknown, f"{directory}: fields this check does not model: {unknown}"
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        objs += compose(path) if path.is_dir() else docs(path)
    for patch in k.get("patches", []):
        (p,) = docs(directory / patch["path"])
        key = (p["kind"], p["metadata"]["name"])
        targets = [i for i, o in enumerate(objs) if (o["kind"], o["metadata"]["name"]) == key]
        assert len(targets) == 1, f"{directory}: patch {patch['path']} matches {len(targets)}"
        objs[targets[0]] = strategic_merge(objs[targets[0]], p)
    for o in objs:
        if "namespace" in k and o["kind"] != "Namespace":
            o.setdefault("metadata", {})["namespace"] = k["namespace"]
            for subject in o.get("subjects", []):  # a binding's service accounts move with it
                if subject["kind"] == "ServiceAccount":
                    subject["namespace"] = k["namespace"]
    for img in k.get("images", []):
        for o in objs:
            for c in pod_spec(o).get("containers", []) if o["kind"] == "Deployment" else []:
                if c["image"] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
    return copy.deepcopy(objs)


def pod_spec(o: dict[str, Any]) -> dict[str, Any]:
    return o["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (o,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_matches_the_kubernetes_schema(path: Path) -> None:
    found = docs(path)
    assert found, f"{path} holds no object"
    for obj in found:
        # strict: an unknown or misspelt field fails too
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_the_schema_check_rejects_a_wrong_manifest() -> None:
    (dep,) = docs(K8S / "base" / "router-deployment.yaml")
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSION, strict=True)
    dep["spec"]["replicas"] = 2
    pod_spec(dep)["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_composes_into_a_router_that_discovers_its_workers(
    overlay: str, tmp_path: Path
) -> None:
    objs = compose(K8S / "overlays" / overlay)
    for o in objs:
        kubernetes_validate.validate(o, KUBE_VERSION, strict=True)
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "an object defined twice"
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {
        "kvrouter"
    }

    router = find(objs, "Deployment", "kvrouter")
    spec = pod_spec(router)
    (c,) = spec["containers"]
    assert router["spec"]["replicas"] == 2
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
    assert c["image"] == "kvrouter:0.1.0" and c["args"][0] == "serve"
    # the Service and the PDB select the router pods
    labels = router["spec"]["template"]["metadata"]["labels"]
    for kind, field in (("Service", ("spec", "selector")), ("PodDisruptionBudget", None)):
        o = find(objs, kind, "kvrouter")
        sel = o["spec"]["selector"] if field else o["spec"]["selector"]["matchLabels"]
        assert sel.items() <= labels.items(), f"the {kind} selects no router pod"
    # the admin key is never on the command line (ps) nor in the environment
    assert not any(a.startswith("--admin-key") for a in c["args"])
    assert not any(
        e["name"] in ("KVROUTER_ADMIN_KEY", "KVROUTER_API_KEYS") for e in c.get("env", [])
    )
    # the config file mounted from the ConfigMap is a valid router config
    (vol,) = [v for v in spec["volumes"] if "configMap" in v]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
    cm = find(objs, "ConfigMap", vol["configMap"]["name"])
    config_path = c["args"][c["args"].index("--config") + 1]
    assert config_path == f"{mount['mountPath']}/router.yaml"
    raw = yaml.safe_load(cm["data"]["router.yaml"])
    # admin_key_file is the Secret's key, mounted from its volume, readable by the router's user
    key_file = Path(raw["admin_key_file"])
    (svol,) = [v for v in spec["volumes"] if "secret" in v]
    (smount,) = [m for m in c["volumeMounts"] if m["name"] == svol["name"]]
    assert smount["readOnly"] and key_file.parent == Path(smount["mountPath"])
    (item,) = [i for i in svol["secret"]["items"] if i["path"] == key_file.name]
    secret = find(objs, "Secret", svol["secret"]["secretName"])["stringData"][item["key"]]
    assert svol["secret"]["defaultMode"] & 0o040 and spec["securityContext"]["fsGroup"] == 10001
    (tmp_path / key_file.name).write_text(secret + "\n")  # (the mounted file, here)
    raw["admin_key_file"] = str(tmp_path / key_file.name)
    # and so is the replicas' peer key, beside it in the same Secret
    peer_file = Path(raw["replicas"]["peer_key_file"])
    assert peer_file.parent == key_file.parent
    (item,) = [i for i in svol["secret"]["items"] if i["path"] == peer_file.name]
    peer = find(objs, "Secret", svol["secret"]["secretName"])["stringData"][item["key"]]
    assert peer != secret, "the peer key is not the admin key: it leaves the pod as CURVE keys"
    (tmp_path / peer_file.name).write_text(peer + "\n")
    raw["replicas"]["peer_key_file"] = str(tmp_path / peer_file.name)
    env_vars = {e["name"]: e.get("value", "from-a-secret") for e in c.get("env", [])}
    settings = load_settings(environ=env_vars, overrides=raw)
    assert settings.admin_key == secret
    disc = settings.kubernetes.discovery
    assert disc.enabled and settings.host == "0.0.0.0"
    assert c["ports"][0]["containerPort"] == settings.port
    # replica sync: on, its port declared, its peers the router's own pods
    rs = settings.replicas
    assert rs.enabled and rs.discovery.enabled and rs.sync_bind is not None
    assert rs.discovery.labels.items() <= labels.items()
    assert int(rs.sync_bind.rsplit(":", 1)[1]) in {p["containerPort"] for p in c["ports"]}
    # the router may list and watch pods
    role = find(objs, "Role", "kvrouter-discovery")
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"])
    assert spec["serviceAccountName"] == "kvrouter"

    # every worker Deployment: its pods are discovered, with the ports they really use
    workers = [
        o
        for o in objs
        if o["kind"] == "Deployment"
        and disc.labels.items() <= o["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert workers, f"{overlay}: no pod carries the discovery labels {disc.labels}"
    for w in workers:
        (wc,) = pod_spec(w)["containers"]
        pod = _as_ready_pod(w)
        cfg = worker_for_pod(pod, disc)
        ports = {p["containerPort"] for p in wc["ports"]}
        assert int(cfg.url.rsplit(":", 1)[1]) in ports
        assert int(cfg.events_endpoint.rsplit(":", 1)[1]) in ports
        assert cfg.replay_endpoint and int(cfg.replay_endpoint.rsplit(":", 1)[1]) in ports
        assert wc["readinessProbe"]["httpGet"]["path"] == "/health"
        _check_kv_event_flags(wc, cfg.events_endpoint, cfg.replay_endpoint)


def _as_ready_pod(deployment: dict[str, Any]) -> Any:
    """The pod a Deployment makes, as the API server would show it once ready."""
    from lightkube.resources.core_v1 import Pod

    tpl = deployment["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**tpl["metadata"], "name": deployment["metadata"]["name"] + "-0"},
        "spec": tpl["spec"],
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    obj = msgspec.json.decode(json.dumps(pod).encode(), type=Pod)
    assert pod_ready(obj)
    return obj


def _check_kv_event_flags(c: dict[str, Any], events: str, replay: str | None) -> None:
    args = c.get("args", [])
    port = events.rsplit(":", 1)[1]
    if any(a.startswith("--kv-events-config=") for a in args):  # vLLM, SGLang
        (flag,) = [a for a in args if a.startswith("--kv-events-config=")]
        conf = json.loads(flag.split("=", 1)[1])
        assert conf["publisher"] == "zmq"
        assert conf["endpoint"] == f"tcp://*:{port}"
        assert (
            replay is not None and conf["replay_endpoint"] == f"tcp://*:{replay.rsplit(':', 1)[1]}"
        )
        if "vllm" in c["image"]:
            assert conf["enable_kv_cache_events"] is True
    else:  # the bundled engine
        assert args[0] == "engine"
        assert args[args.index("--events") + 1] == f"tcp://*:{port}"
        assert replay is not None
        assert args[args.index("--replay") + 1] == f"tcp://*:{replay.rsplit(':', 1)[1]}"


def _admits(
    policy: dict[str, Any], dst: dict[str, str], port: dict[str, Any], src: dict[str, str]
) -> bool:
    """Whether a NetworkPolicy (ingress, pod selectors by matchLabels: all these use) lets a
    pod labelled ``src`` in its namespace reach container ``port`` of a pod labelled ``dst``.
    A policy that does not select ``dst`` admits everything (it says nothing about that pod)."""
    if not _selects(policy, dst):
        return True
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        if peers is not None and not any(
            set(peer) == {"podSelector"}
            and peer["podSelector"]["matchLabels"].items() <= src.items()
            for peer in peers
        ):
            continue
        for p in rule.get("ports") or [{}]:
            if p.get("protocol", "TCP") != port.get("protocol", "TCP"):
                continue
            want = p.get("port")
            if (
                want is None
                or want == port.get("name")
                or (
                    isinstance(want, int)
                    and want <= port["containerPort"] <= p.get("endPort", want)
                )
            ):
                return True
    return False


@pytest.mark.parametrize(
    "directory",
    [K8S / "overlays" / o for o in OVERLAYS] + [ROOT / "deploy" / "gateway"],
    ids=lambda d: d.name,
)
def test_only_placement_peers_reach_the_sync_port(directory: Path) -> None:
    """Sync messages steer placement, so the sync port is closed to all but the pods replica
    sync discovers as peers; every other port of every pod is as reachable as without it."""
    objs = compose(directory)
    policy = find(objs, "NetworkPolicy", "kvrouter-sync")
    raw = yaml.safe_load(find(objs, "ConfigMap", "kvrouter-config")["data"]["router.yaml"])
    raw.pop("admin_key_file")  # (mounted Secrets: not what this checks)
    raw["replicas"].pop("peer_key_file")
    raw["replicas"]["trusted_network"] = True
    replicas = load_settings(environ={}, overrides=raw).replicas
    assert replicas.enabled and replicas.sync_bind is not None
    sync_port = int(replicas.sync_bind.rsplit(":", 1)[1])
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    peers = [d for d in deployments if replicas.discovery.labels.items() <= _labels(d).items()]
    others = [_labels(d) for d in deployments if d not in peers]
    assert peers and others, "both placement peers and other pods to refuse"
    for dep in peers:
        (c,) = pod_spec(dep)["containers"]
        for port in c["ports"]:
            if port["containerPort"] == sync_port:
                assert port["name"] == "sync"
                assert all(_admits(policy, _labels(dep), port, _labels(p)) for p in peers)
                assert not any(_admits(policy, _labels(dep), port, o) for o in [{}, *others])
            else:  # clients, the gateway, Prometheus: from anywhere
                assert _admits(policy, _labels(dep), port, {}), f"{port} closed by the policy"
    # the workers are not selected: their ports are the fleet's business
    assert not any(_selects(policy, o) for o in others)


def _labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    return policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()  # type: ignore[no-any-return]
