"""Worker roles in the fleet: a pod's role and SGLang bootstrap port as discovery reads them
(``llm-d.ai/role`` as llm-d reads it, the bootstrap-port annotations), and the readiness rule of a
fleet with roles (:meth:`Registry.lacking_roles`)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from router.fleet.discovery import pod_role, with_role
from router.fleet.pods import PodNotUsable, worker_for_pod
from router.fleet.registry import Registry
from router.settings import DiscoverySettings, HealthSettings, WorkerConfig


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> Any:
    d = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "w-0", "labels": labels or {}, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "c"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.7"},
    }
    return msgspec.json.decode(json.dumps(d).encode(), type=Pod)


def role_of(value: str) -> str:
    return pod_role(pod({"llm-d.ai/role": value}))[0]


def test_llm_d_role_values_as_llm_d_reads_them():
    # llm-d-inference-scheduler pkg/plugins/filter/roles.go: the prefill filter takes prefill,
    # encode-prefill, prefill-decode, both, encode-prefill-decode; the decode filter decode,
    # prefill-decode, both, encode-prefill-decode
    assert role_of("prefill") == "prefill"
    assert role_of("encode-prefill") == "prefill"
    assert role_of("decode") == "decode"
    assert role_of("prefill-decode") == "both"
    assert role_of("both") == "both"  # llm-d's older name of prefill-decode
    assert role_of("encode-prefill-decode") == "both"
    assert pod_role(pod()) == ("both", None, [])  # no label: a whole-request worker
    assert pod_role(pod({"llm-d.ai/role": "decode"})) == ("decode", None, [])


def test_an_unknown_role_is_both_with_a_warning_and_an_encoder_is_no_worker():
    role, port, warnings = pod_role(pod({"llm-d.ai/role": "Prefill"}))
    assert (role, port) == ("both", None)
    (w,) = warnings
    assert "llm-d.ai/role='Prefill'" in w and "taken as both" in w
    with pytest.raises(PodNotUsable, match="encode"):
        pod_role(pod({"llm-d.ai/role": "encode"}))


@pytest.mark.parametrize(
    ("annotations", "port", "warned"),
    [
        ({"sglang.ai/bootstrap-port": "8998"}, 8998, None),
        ({"vllm.ai/bootstrap-port": "9000"}, 9000, None),
        ({"sglang.ai/bootstrap-port": "8998", "vllm.ai/bootstrap-port": "9000"}, 8998, None),
        ({"sglang.ai/bootstrap-port": " 8998 "}, 8998, None),
        ({"sglang.ai/bootstrap-port": "http"}, None, "sglang.ai/bootstrap-port='http'"),
        ({"sglang.ai/bootstrap-port": "0"}, None, "sglang.ai/bootstrap-port='0'"),
        ({"vllm.ai/bootstrap-port": "70000"}, None, "vllm.ai/bootstrap-port='70000'"),
        # the first annotation present decides: a malformed one is not mended by the other
        (
            {"sglang.ai/bootstrap-port": "x", "vllm.ai/bootstrap-port": "9000"},
            None,
            "sglang.ai/bootstrap-port='x'",
        ),
    ],
)
def test_bootstrap_port_annotation(annotations, port, warned):
    role, got, warnings = pod_role(pod({"llm-d.ai/role": "prefill"}, annotations))
    assert (role, got) == ("prefill", port)
    if warned is None:
        assert warnings == []
    else:
        (w,) = warnings
        assert warned in w and "no bootstrap port" in w


def test_with_role_keeps_the_rest_of_the_pods_worker():
    p = pod({"llm-d.ai/role": "prefill"}, {"sglang.ai/bootstrap-port": "8998"})
    base = worker_for_pod(p, DiscoverySettings(enabled=True))
    cfg, warnings = with_role(base, p)
    assert (cfg.role, cfg.bootstrap_port, warnings) == ("prefill", 8998, [])
    assert msgspec.structs.replace(cfg, role="both", bootstrap_port=None) == base


def fleet(*roles: str) -> Registry:
    reg = Registry(HealthSettings())
    for i, role in enumerate(roles):
        reg.add(
            WorkerConfig(id=f"{role}{i}", url="http://h", events_endpoint="tcp://h:1", role=role)
        )
    return reg


def live_all(worker_id: str) -> bool:
    return True


def test_a_fleet_of_both_workers_lacks_no_role():
    """Its readiness stays the one rule of any fleet (some routable worker): no role here."""
    assert fleet().lacking_roles(live_all) == []
    reg = fleet("both", "both")
    for st in reg.states():
        st.healthy = False
    assert reg.lacking_roles(live_all) == []


def test_a_split_fleet_needs_a_routable_decode_and_prefill_worker():
    reg = fleet("prefill", "decode")
    assert reg.lacking_roles(live_all) == []
    reg.workers["decode1"].healthy = False
    assert reg.lacking_roles(live_all) == ["decode"]
    reg.workers["decode1"].healthy = True
    # healthy but its event stream not live yet: not routable
    assert reg.lacking_roles(lambda w: w != "prefill0") == ["prefill"]
    assert reg.lacking_roles(lambda w: False) == ["decode", "prefill"]


def test_a_both_worker_decodes_and_stands_in_for_prefill():
    reg = fleet("prefill", "both")
    reg.workers["prefill0"].healthy = False
    assert reg.lacking_roles(live_all) == []  # the both worker serves whole requests
    reg.workers["both1"].healthy = False
    assert reg.lacking_roles(live_all) == ["decode"]
    # prefill + decode + both: the both worker (even down) means no prefill worker is needed
    reg = fleet("prefill", "decode", "both")
    reg.workers["prefill0"].healthy = False
    reg.workers["both2"].healthy = False
    assert reg.lacking_roles(live_all) == []


def test_decode_only_and_prefill_only_fleets():
    assert fleet("decode", "decode").lacking_roles(live_all) == []  # prefills locally
    assert fleet("prefill").lacking_roles(live_all) == ["decode"]
