"""The replicas' peer key: read from its file with errors that name the path, never the content;
the CURVE pair and the snapshot token derived from it, each its own, the same in every replica."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import zmq

from router.errors import ConfigError
from router.runtime.replicas import PeerKey, peer_key
from router.settings import ReplicaSettings

SECRET = "0123456789abcdef0123456789abcdef"


def test_every_replica_derives_the_same_distinct_credentials(tmp_path: Path) -> None:
    (tmp_path / "a").write_text(SECRET + "\n")
    (tmp_path / "b").write_text(SECRET)
    a, b = PeerKey.read(str(tmp_path / "a")), PeerKey.read(str(tmp_path / "b"))
    assert a.curve() == b.curve() and a.snapshot_token() == b.snapshot_token()
    public, secret = a.curve()
    assert zmq.curve_public(secret) == public and len(public) == 40
    token = a.snapshot_token()
    assert SECRET not in token and token.encode() not in (public, secret)
    flipped = token[:-1] + ("1" if token[-1] == "0" else "0")
    assert a.allows(token) and not a.allows(flipped) and not a.allows(SECRET)
    other = PeerKey(b"another-secret-of-enough-bytes")
    assert other.curve() != a.curve() and not other.allows(token)
    assert SECRET not in repr(a)


def test_a_missing_or_short_key_names_the_file_not_the_content(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read .*/nope"):
        PeerKey.read(str(tmp_path / "nope"))
    (tmp_path / "short").write_text("tiny-secret\n")
    with pytest.raises(ConfigError, match="holds 11 bytes") as e:
        PeerKey.read(str(tmp_path / "short"))
    assert "tiny-secret" not in str(e.value)


def test_trusting_the_network_is_said_at_start(caplog: pytest.LogCaptureFixture) -> None:
    trusted = ReplicaSettings(peers=["tcp://peer:5600"], trusted_network=True)
    with caplog.at_level(logging.WARNING, "kvrouter.replicas"):
        assert peer_key(trusted) is None
    assert "without authentication" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvrouter.replicas"):  # ipc: siblings, no warning
        assert peer_key(ReplicaSettings(sync_bind="ipc:///tmp/x.sock")) is None
    assert caplog.text == ""
