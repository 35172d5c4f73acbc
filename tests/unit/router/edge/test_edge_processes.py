"""``router.edge.processes``'s pure parts: each process's settings (one process, its own
``ipc://`` endpoint, its siblings' as peers beside the configured ones) and the listener every
process inherits."""

from __future__ import annotations

import socket

import pytest

from router.edge.processes import local_url, process_settings
from router.edge.server import bind_listener
from router.errors import ConfigError
from router.settings import load_settings


def test_each_process_publishes_on_its_own_endpoint_and_hears_its_siblings() -> None:
    s = load_settings(
        environ={},
        overrides={
            "server": {"processes": 3},
            "replicas": {"peers": ["tcp://other:5600"], "trusted_network": True},
            "snapshot": {"path": "/var/idx"},
            "epp": {"port": 9002},
        },
    )
    got, i = process_settings(s, "1/3", "/run/d")
    assert i == 1 and got.server.processes == 1
    assert got.snapshot.path is None  # one writer of the file: process 0
    assert got.epp.port is None  # one endpoint picker: process 0
    first = process_settings(s, "0/3", "/run/d")[0]
    assert first.snapshot.path == "/var/idx" and first.epp.port == 9002
    assert got.replicas.sync_bind == "ipc:///run/d/1.sock"
    assert got.replicas.peers == ["tcp://other:5600", "ipc:///run/d/0.sock", "ipc:///run/d/2.sock"]
    assert got.replicas.enabled and got.port == s.port
    for bad in ("3/3", "x", "1/2/3", "-1/2"):
        with pytest.raises(ConfigError):
            process_settings(s, bad, "/run/d")
    with pytest.raises(ConfigError):
        process_settings(s, "0/2", "")


def test_the_shared_listener_is_inheritable_and_reached_on_loopback() -> None:
    sock = bind_listener("0.0.0.0", 0)
    try:
        assert sock.get_inheritable()
        url = local_url(sock)
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into its queue (nobody serves it here)
    finally:
        sock.close()
