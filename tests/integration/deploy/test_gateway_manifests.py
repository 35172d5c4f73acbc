"""``deploy/gateway/``: kvrouter as the endpoint picker (EPP) of a Gateway API Inference Extension
gateway. The core objects (the EPP Deployment, Service, PodDisruptionBudget) are validated against
the Kubernetes schemas (``kubernetes-validate``, offline); the InferencePool and the HTTPRoute are
CRDs that package ships no schema for, so they are checked against a strict schema written here
from the InferencePool v1 CRD's constraints (required fields, enums, ranges; no unknown field).
The kustomization is composed as kustomize does (:func:`compose` of the Kubernetes check) and
checked against the code it configures: the EPP's settings load from its ConfigMap and
environment (TLS, the default), its probes ask the router's HTTP /health and /ready (the
kubelet's gRPC probes speak no TLS), the pool's EPP reference reaches the EPP's gRPC port, the
pool selects exactly the pods the router discovers, on their OpenAI port.
``deploy/gateway/envoy.yaml`` is read for the endpoint picker contract (the filter chain,
processing modes, fail-closed, TLS to the EPP, the ORIGINAL_DST cluster on the picked
endpoint); the real Envoy validates and runs it in the stage ``tests/stages/envoy``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_kubernetes_manifests import KUBE_VERSION, compose, docs, find, pod_spec

from router.settings import ProxySettings, load_settings

ROOT = Path(__file__).resolve().parents[3]
GATEWAY = ROOT / "deploy" / "gateway"
CRD_KINDS = {"InferencePool", "HTTPRoute"}

_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}


def _strict(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


_METADATA = _strict({"name": _NAME, "namespace": _NAME, "labels": {"type": "object"}}, ["name"])
INFERENCE_POOL = _strict(
    {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": _METADATA,
        "spec": _strict(
            {
                "selector": _strict(
                    {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            "additionalProperties": _LABEL_VALUE,
                        }
                    },
                    ["matchLabels"],
                ),
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "uniqueItems": True,
                    "items": _strict({"number": _PORT}, ["number"]),
                },
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": _strict(
                    {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": _NAME,
                        "port": _strict({"number": _PORT}, ["number"]),
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    ["name"],
                ),
            },
            ["selector", "targetPorts"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)
_REF = {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME, "namespace": _NAME}
_BACKEND_REF = _strict({**_REF, "port": _PORT, "weight": {"type": "integer"}}, ["name"])
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}  # Gateway API's
HTTP_ROUTE = _strict(
    {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": _METADATA,
        "spec": _strict(
            {
                "parentRefs": {"type": "array", "minItems": 1, "items": _strict(_REF, ["name"])},
                "rules": {
                    "type": "array",
                    "minItems": 1,
                    "items": _strict(
                        {
                            "matches": {"type": "array"},
                            "backendRefs": {
                                "type": "array",
                                "minItems": 1,
                                "items": _BACKEND_REF,
                            },
                            "timeouts": _strict({"request": _DURATION}, []),
                        },
                        ["backendRefs"],
                    ),
                },
            },
            ["parentRefs", "rules"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)
SCHEMAS = {"InferencePool": INFERENCE_POOL, "HTTPRoute": HTTP_ROUTE}


def validate(obj: dict[str, Any]) -> None:
    if obj["kind"] in CRD_KINDS:
        jsonschema.validate(obj, SCHEMAS[obj["kind"]])
        if obj["kind"] == "InferencePool":
            ref = obj["spec"].get("endpointPickerRef", {})
            # the CRD's CEL rule: a Service reference needs its port
            assert ref.get("kind", "Service") != "Service" or "port" in ref
    else:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def gateway_files() -> list[Path]:
    k = yaml.safe_load((GATEWAY / "kustomization.yaml").read_text())
    return [GATEWAY / r for r in k["resources"] if (GATEWAY / r).is_file()]


@pytest.mark.parametrize("path", gateway_files(), ids=lambda p: p.name)
def test_every_gateway_manifest_matches_its_schema(path: Path) -> None:
    found = docs(path)
    assert found, f"{path} holds no object"
    for obj in found:
        validate(obj)


def test_the_crd_checks_reject_a_wrong_pool_and_route() -> None:
    (pool,) = docs(GATEWAY / "inferencepool.yaml")
    for bad in (
        {"failureMode": "FailSometimes"},
        {"port": {"number": 0}},
        {"nmae": "typo"},
    ):
        wrong = {
            **pool,
            "spec": {
                **pool["spec"],
                "endpointPickerRef": {**pool["spec"]["endpointPickerRef"], **bad},
            },
        }
        with pytest.raises(jsonschema.ValidationError):
            validate(wrong)
    with pytest.raises(jsonschema.ValidationError):
        validate({**pool, "spec": {**pool["spec"], "targetPorts": []}})
    (route,) = docs(GATEWAY / "httproute.yaml")
    with pytest.raises(jsonschema.ValidationError):
        validate({**route, "spec": {**route["spec"], "rules": [{"backendRef": {}}]}})


def test_gateway_composes_into_an_epp_the_pool_and_route_reach() -> None:
    objs = compose(GATEWAY)
    for o in objs:
        validate(o)
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "an object defined twice"
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {
        "kvrouter"
    }

    # the EPP: the router image, serving, with the router's config and hardening
    epp = find(objs, "Deployment", "kvrouter-epp")
    router = find(objs, "Deployment", "kvrouter")
    spec, rspec = pod_spec(epp), pod_spec(router)
    (c,), (rc,) = spec["containers"], rspec["containers"]
    assert c["image"] == rc["image"] == "kvrouter:0.1.0" and c["args"] == rc["args"]
    assert spec["securityContext"] == rspec["securityContext"]
    assert c["securityContext"] == rc["securityContext"]
    assert spec["volumes"] == rspec["volumes"] and c["volumeMounts"] == rc["volumeMounts"]
    assert spec["serviceAccountName"] == rspec["serviceAccountName"]
    assert epp["spec"]["replicas"] >= 2, "FailClose: one EPP pod would be a single point of failure"

    # its settings: the ConfigMap's router.yaml plus its environment turn the EPP on
    cm = find(objs, "ConfigMap", spec["volumes"][0]["configMap"]["name"])
    raw = yaml.safe_load(cm["data"]["router.yaml"])
    raw.pop("admin_key_file")  # mounted Secrets, checked by the Kubernetes manifests' test
    raw["replicas"].pop("peer_key_file")
    raw["replicas"]["trusted_network"] = True
    env = {e["name"]: e["value"] for e in c["env"]}
    settings = load_settings(environ=env, overrides=raw)
    assert settings.epp.port is not None and settings.epp.host == "0.0.0.0"
    # TLS, as the gateway speaks it to an EPP (GIE's picker serves TLS by default too)
    assert not settings.epp.plaintext
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == settings.epp.port and ports["http"] == settings.port
    if settings.replicas.sync_bind is not None:  # the shared config's replica sync binds here too
        assert int(settings.replicas.sync_bind.rsplit(":", 1)[1]) in ports.values()
        # and its pods are the router's peers: both carry the labels sync discovers peers by
        pod_labels = epp["spec"]["template"]["metadata"]["labels"]
        assert settings.replicas.discovery.labels.items() <= pod_labels.items(), pod_labels
    # the kubelet's gRPC probes speak no TLS: the router's HTTP port, whose /ready the EPP's
    # gRPC readiness follows
    for probe, path in (
        ("livenessProbe", "/health"),
        ("readinessProbe", "/ready"),
        ("startupProbe", "/health"),
    ):
        assert c[probe]["httpGet"] == {"port": "http", "path": path}, probe

    # the Service: the EPP pods only, its gRPC port as HTTP/2
    svc = find(objs, "Service", "kvrouter-epp")
    labels = epp["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    router_svc = find(objs, "Service", "kvrouter")
    assert not router_svc["spec"]["selector"].items() <= labels.items(), "proxy Service hits EPPs"
    pdb = find(objs, "PodDisruptionBudget", "kvrouter-epp")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (grpc_port,) = [p for p in svc["spec"]["ports"] if p["targetPort"] == "grpc"]
    assert grpc_port["appProtocol"] == "http2"

    # the pool: its EPP is that Service's gRPC port, failing closed
    pool = find(objs, "InferencePool", "kvrouter-pool")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["name"] == svc["metadata"]["name"]
    assert ref["port"]["number"] == grpc_port["port"]
    assert ref["failureMode"] == "FailClose"

    # the pool's members are the router's workers: the discovery labels, on their HTTP port
    disc = settings.kubernetes.discovery
    assert pool["spec"]["selector"]["matchLabels"] == disc.labels
    targets = {p["number"] for p in pool["spec"]["targetPorts"]}
    members = [
        o
        for o in objs
        if o["kind"] == "Deployment"
        and disc.labels.items() <= o["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert members, "the pool selects no pod"
    for m in members:
        tpl = m["spec"]["template"]
        assert int(tpl["metadata"]["annotations"]["kvrouter.io/http-port"]) in targets
        (wc,) = tpl["spec"]["containers"]
        assert targets <= {p["containerPort"] for p in wc["ports"]}
    for o in (epp, router):  # neither the router nor its EPP is a model server
        assert not disc.labels.items() <= o["spec"]["template"]["metadata"]["labels"].items()

    # the route sends everything to the pool, with no deadline on a stream
    route = find(objs, "HTTPRoute", "kvrouter")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    assert rule["timeouts"]["request"] == "0s"


# ------------------------------------------------------------------------ the standalone Envoy


def _envoy() -> dict[str, Any]:
    return yaml.safe_load((GATEWAY / "envoy.yaml").read_text())  # type: ignore[no-any-return]


def test_standalone_envoy_speaks_the_endpoint_picker_protocol() -> None:
    config = _envoy()
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == 8081
    assert config["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 9901,
    }
    (chain,) = listener["filter_chains"]
    (hcm_filter,) = chain["filters"]
    hcm = hcm_filter["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["failure_mode_allow"] is False
    assert ext["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "response_trailer_mode": "SEND",
    }
    assert ext["allow_mode_override"] is False
    assert "envoy.lb.subset_hint" in ext["metadata_options"]["forwarding_namespaces"]["untyped"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    epp = clusters[ext["grpc_service"]["envoy_grpc"]["cluster_name"]]
    http2 = epp["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in http2["explicit_http_config"]
    (group,) = epp["load_assignment"]["endpoints"]
    (ep,) = group["lb_endpoints"]
    assert ep["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 9002,
    }
    (hc,) = epp["health_checks"]
    assert hc["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    # TLS to the EPP (its default), verifying no certificate: a self-signed one is new each start
    tls = epp["transport_socket"]
    assert tls["name"] == "envoy.transport_sockets.tls"
    context = tls["typed_config"]["common_tls_context"]
    assert context["alpn_protocols"] == ["h2"] and "validation_context" not in context

    # every request goes where the EPP's header says, with no deadline on the stream
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    (route,) = vhost["routes"]
    assert route["match"] == {"prefix": "/"} and route["route"]["timeout"] == "0s"
    workers = clusters[route["route"]["cluster"]]
    assert (workers["type"], workers["lb_policy"]) == ("ORIGINAL_DST", "CLUSTER_PROVIDED")
    assert workers["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    # an idle worker connection closes on Envoy's side first, as the proxy's pool does: under
    # the workers' own idle timeout (uvicorn's 5 s), never a request sent into a worker's FIN
    http1 = workers["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    idle = http1["common_http_protocol_options"]["idle_timeout"]
    assert idle == f"{ProxySettings().keepalive_s:g}s" and float(idle[:-1]) < 5
    fmt = hcm["access_log"][0]["typed_config"]["log_format"]["json_format"]
    assert fmt["upstream_host"] == "%UPSTREAM_HOST%"
    assert fmt["destination_endpoint"] == "%REQ(x-gateway-destination-endpoint)%"


def test_standalone_envoy_and_the_kubernetes_epp_use_one_port() -> None:
    """The EPP port Envoy calls is the one the Kubernetes EPP listens on (and the docs' 9002)."""
    (group,) = [c for c in _envoy()["static_resources"]["clusters"] if c["name"] == "kvrouter_epp"]
    port = group["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    (dep,) = docs(GATEWAY / "epp-deployment.yaml")
    (c,) = pod_spec(dep)["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert int(env["KVROUTER_EPP__PORT"]) == port["socket_address"]["port_value"]
