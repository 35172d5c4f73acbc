"""The Envoy renderer (:mod:`kvrouter.gateway`) on the committed ``deploy/gateway/envoy.yaml``:
this run's addresses replaced and nothing else, the ``direct`` listener the same connection
manager minus ext_proc, the binary's lookup order, and the router command that logs its EPP's
port. (A real Envoy runs these configs in tests/stages/envoy.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from stand_in import stand_in_executable

from kvrouter import gateway
from kvrouter.gateway import (
    DIRECT,
    ENVOY_BIN_ENV,
    EPP_CLUSTER,
    EPP_READY,
    EXT_PROC,
    GatewayError,
    cluster,
    connection_manager,
    envoy_binary,
    http_filter,
    listener,
    load,
    render,
)


def _endpoint(config: dict, name: str) -> dict:
    (group,) = cluster(config, name)["load_assignment"]["endpoints"]
    (ep,) = group["lb_endpoints"]
    return ep["endpoint"]["address"]["socket_address"]  # type: ignore[no-any-return]


def test_render_replaces_addresses_and_keeps_the_rest_of_the_committed_config() -> None:
    source = load()
    config = render(source, epp=("127.0.0.1", 9123), access_log="/tmp/x.log", port=8555)
    assert listener(config)["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 8555,
    }
    assert config["admin"]["address"]["socket_address"]["port_value"] == 0
    assert _endpoint(config, EPP_CLUSTER) == {"address": "127.0.0.1", "port_value": 9123}
    assert connection_manager(config)["access_log"][0]["typed_config"]["path"] == "/tmp/x.log"
    # the filter chain, its ext_proc modes and the clusters are the committed file's
    assert http_filter(config, EXT_PROC) == http_filter(source, EXT_PROC)
    assert config["static_resources"]["clusters"] == [
        c if c["name"] != EPP_CLUSTER else cluster(config, EPP_CLUSTER)
        for c in source["static_resources"]["clusters"]
    ]
    assert _endpoint(source, EPP_CLUSTER)["port_value"] == 9002  # the source is untouched
    assert [ls["name"] for ls in config["static_resources"]["listeners"]] == ["inference"]


def test_the_direct_listener_is_the_same_connection_manager_without_ext_proc() -> None:
    config = render(load(), epp=("127.0.0.1", 9123), direct=("127.0.0.1", 7001))
    main, direct = connection_manager(config), connection_manager(config, DIRECT)
    assert [f["name"] for f in main["http_filters"]] == [EXT_PROC, "envoy.filters.http.router"]
    assert [f["name"] for f in direct["http_filters"]] == ["envoy.filters.http.router"]
    (vhost,) = direct["route_config"]["virtual_hosts"]
    (route,) = vhost["routes"]
    assert route["route"]["cluster"] == "direct_upstream"
    assert route["route"]["timeout"] == "0s"  # the committed route's settings stay
    assert direct["access_log"] == main["access_log"]
    upstream = cluster(config, "direct_upstream")
    assert upstream["type"] == "STATIC" and "original_dst_lb_config" not in upstream
    assert _endpoint(config, "direct_upstream") == {"address": "127.0.0.1", "port_value": 7001}
    assert listener(config, DIRECT)["address"]["socket_address"]["port_value"] == 0
    with pytest.raises(GatewayError, match="listener named 'nope'"):
        listener(config, "nope")


def test_envoy_binary_is_the_flag_then_the_variable_then_venv_envoy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, var = stand_in_executable(tmp_path / "a"), stand_in_executable(tmp_path / "b")
    assert envoy_binary(flag, {ENVOY_BIN_ENV: var}) == flag
    assert envoy_binary(None, {ENVOY_BIN_ENV: var}) == var
    monkeypatch.setattr(gateway, "_VENV_ENVOY", tmp_path / "none")
    with pytest.raises(GatewayError, match=r"\.ci/envoy\.sh"):
        envoy_binary(None, {})
    (tmp_path / "plain").write_text("not executable")
    with pytest.raises(GatewayError, match="no Envoy binary"):
        envoy_binary(str(tmp_path / "plain"), {})


def test_the_epp_ready_line_gives_the_port() -> None:
    m = EPP_READY.search("kvrouter EPP listening on 127.0.0.1:40123")
    assert m is not None and m.group(2) == "40123"
    assert os.path.isabs(str(gateway.ENVOY_YAML)) and gateway.ENVOY_YAML.exists()
