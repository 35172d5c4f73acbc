"""``replicas:`` and ``server.processes``: defaults keep one router alone; a bad value stops the
start naming its key."""

from __future__ import annotations

import pytest

from router.errors import ConfigError
from router.settings import load_settings


def test_sync_is_off_by_default_and_on_with_any_of_its_keys() -> None:
    s = load_settings(environ={})
    assert not s.replicas.enabled and s.server.processes == 1 and s.server.metrics_port is None
    env = {
        "KVROUTER_REPLICAS__PEERS": "[tcp://peer:5600]",
        "KVROUTER_REPLICAS__TRUSTED_NETWORK": "true",
    }
    on = load_settings(environ=env)
    assert on.replicas.enabled and on.replicas.peers == ["tcp://peer:5600"]
    assert load_settings(
        environ={}, overrides={"replicas": {"sync_bind": "ipc:///x"}}
    ).replicas.enabled


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"replicas": {"sync_bind": "http://x:1"}}, "replicas.sync_bind"),
        ({"replicas": {"peers": ["x:1"]}}, "replicas.peers[0]"),
        ({"replicas": {"warm_from": ["tcp://x:1"]}}, "replicas.warm_from[0]"),
        ({"replicas": {"ticket_ttl_s": 0}}, "replicas.ticket_ttl_s"),
        ({"replicas": {"max_remote_tickets": 0}}, "replicas.max_remote_tickets"),
        ({"replicas": {"max_hashes": 100_000}}, "replicas.max_message_bytes"),
        ({"replicas": {"heartbeat_s": 3.0}}, "replicas.peer_timeout_s"),
        (
            {"replicas": {"discovery": {"enabled": True}, "trusted_network": True}},
            "replicas.sync_bind",
        ),
        (
            {
                "replicas": {
                    "discovery": {"enabled": True},
                    "sync_bind": "tcp://0.0.0.0:0",
                    "trusted_network": True,
                }
            },
            "replicas.sync_bind",
        ),
        ({"replicas": {"discovery": {"labels": {"a b": "x"}}}}, "replicas.discovery.labels.a b"),
        ({"server": {"processes": 0}}, "server.processes"),
        ({"server": {"processes": 4, "metrics_port": 65533}}, "server.metrics_port"),
        (
            {
                "server": {"processes": 2},
                "replicas": {"sync_bind": "tcp://0.0.0.0:5600", "trusted_network": True},
            },
            "replicas.sync_bind",
        ),
        # sync over TCP, discovery and warm starts need the peer key, or an explicit trust
        ({"replicas": {"peers": ["tcp://peer:5600"]}}, "replicas.peer_key_file"),
        ({"replicas": {"sync_bind": "tcp://0.0.0.0:5600"}}, "replicas.peer_key_file"),
        ({"replicas": {"warm_from": ["http://peer:8000"]}}, "replicas.peer_key_file"),
        ({"replicas": {"peer_key_file": "/nonexistent/key"}}, "replicas.peer_key_file"),
        # sync's budgets (issue 37): each must hold what it budgets
        ({"replicas": {"drain_budget_ms": 0}}, "replicas.drain_budget_ms"),
        ({"replicas": {"drain_max_hashes": 0}}, "replicas.drain_max_hashes"),
        ({"replicas": {"max_peer_state_mib": 0}}, "replicas.max_peer_state_mib"),
        (
            {"replicas": {"max_peer_state_mib": 64, "max_remote_state_mib": 32}},
            "replicas.max_remote_state_mib",
        ),
        ({"replicas": {"max_queue_mib": 0.2}}, "replicas.max_queue_mib"),  # < a 256 KiB message
    ],
)
def test_bad_values_name_their_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(environ={}, overrides=overrides)
    assert f"invalid config: {key}:" in str(e.value)


def test_discovery_with_a_fixed_sync_port_is_accepted() -> None:
    s = load_settings(
        environ={},
        overrides={
            "replicas": {
                "sync_bind": "tcp://0.0.0.0:5600",
                "discovery": {"enabled": True},
                "trusted_network": True,
            }
        },
    )
    d = s.replicas.discovery.as_discovery()
    assert d.enabled and d.labels == s.replicas.discovery.labels
