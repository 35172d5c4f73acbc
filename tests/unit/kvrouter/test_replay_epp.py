"""Live replay's policy ``kvrouter-epp`` (policy kvrouter through Envoy and the router's endpoint
picker): what the options accept and refuse before any fleet starts, and Envoy's CPU column
in the table. (The run itself, with a real Envoy: tests/stages/envoy/test_replay_via_envoy.py.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from stand_in import stand_in_executable

from kvrouter import gateway
from kvrouter.replay.cli import main
from kvrouter.replay.live import (
    EPP_POLICY,
    PEER_POLICIES,
    LiveTargets,
    PolicyRun,
    add_live_arguments,
    run_policy,
    targets_from_args,
)
from kvrouter.replay.live_client import LiveOutcome
from kvrouter.replay.report import format_table, row

SHAPE = {"workers": 2, "block_size": 16, "gpu_blocks": 64, "speedup": 1.0}


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--policies")
    add_live_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def envoy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A stand-in executable for the Envoy binary (nothing here starts it); none elsewhere."""
    monkeypatch.delenv(gateway.ENVOY_BIN_ENV, raising=False)
    monkeypatch.setattr(gateway, "_VENV_ENVOY", tmp_path / "no-venv-envoy")
    return stand_in_executable(tmp_path / "envoy")


def test_kvrouter_epp_is_a_peer_policy_that_needs_envoy_only_when_asked_for(
    envoy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert EPP_POLICY == "kvrouter-epp" and EPP_POLICY in PEER_POLICIES
    # not asked for: no binary needed, none looked up
    t = targets_from_args(_parse("--policies", "kvrouter,round_robin"), **SHAPE)
    assert t.envoy_bin is None and t.fleet is not None
    t = targets_from_args(
        _parse("--policies", "kvrouter,kvrouter-epp", "--envoy-bin", envoy), **SHAPE
    )
    assert t.envoy_bin == envoy and t.fleet is not None
    monkeypatch.setenv(gateway.ENVOY_BIN_ENV, envoy)  # the variable, when no flag
    assert targets_from_args(_parse("--policies", "kvrouter-epp"), **SHAPE).envoy_bin == envoy
    head = targets_from_args(_parse("--policies", "kvrouter-epp-head"), **SHAPE)
    assert "kvrouter-epp-head" in PEER_POLICIES and head.envoy_bin == envoy


def test_head_only_renders_envoy_without_the_answer_s_body() -> None:
    modes = lambda c: gateway.http_filter(c, gateway.EXT_PROC)["processing_mode"]  # noqa: E731
    full = gateway.render(gateway.load(), epp=("127.0.0.1", 9002))
    head = gateway.render(gateway.load(), epp=("127.0.0.1", 9002), head_only=True)
    assert modes(full)["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert modes(head)["response_body_mode"] == "NONE"
    # trailers still sent: Envoy keeps the stream open until the answer's end (gateway.py)
    assert modes(head)["response_trailer_mode"] == "SEND"
    assert modes(head)["request_body_mode"] == "FULL_DUPLEX_STREAMED"  # the request: as ever


def test_kvrouter_epp_is_refused_up_front_without_envoy_or_without_a_fleet(envoy: str) -> None:
    with pytest.raises(ValueError, match="no Envoy binary"):
        targets_from_args(_parse("--policies", "kvrouter-epp"), **SHAPE)
    with pytest.raises(ValueError, match="fleet of our own"):
        argv = ("--policies", "kvrouter-epp", "--envoy-bin", envoy, "--router-url", "http://r")
        targets_from_args(_parse(*argv), **SHAPE)
    with pytest.raises(ValueError, match="fleet of our own"):  # called directly, the same
        run_policy(EPP_POLICY, [], LiveTargets(router_url="http://r"), speedup=1.0)
    with pytest.raises(ValueError, match="kvrouter-epp-head runs on a fleet of our own"):
        argv = ("--policies", "kvrouter-epp-head", "--envoy-bin", envoy, "--worker-url", "http://w")
        targets_from_args(_parse(*argv), **SHAPE)


def test_the_replay_command_exits_2_before_any_fleet_without_envoy(
    envoy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--mode", "live", "--workload", "shared-prefix", "--count", "2", "--no-progress"]
    assert main([*argv, "--policies", "kvrouter,kvrouter-epp"]) == 2
    assert "no Envoy binary" in capsys.readouterr().err


def _outcome() -> LiveOutcome:
    return LiveOutcome(0, ttft_s=0.01, e2e_s=0.02, prompt_tokens=10, cached_tokens=5)


def test_envoy_cpu_is_a_column_of_the_rows_that_have_it() -> None:
    proxy = PolicyRun("kvrouter", [_outcome()] * 4, 1.0, router_cpu_s=0.2)
    epp = PolicyRun(EPP_POLICY, [_outcome()] * 4, 1.0, router_cpu_s=0.1, gateway_cpu_s=0.06)
    rows = [row(proxy, 0.5), row(epp, 0.5)]
    assert "envoy_cpu_s/1k" not in rows[0]
    assert rows[1]["envoy_cpu_s/1k"] == 15.0 and rows[1]["cpu_s/1k"] == 25.0
    lines = format_table("t", rows).splitlines()
    assert lines[1].split()[-1] == "envoy_cpu_s/1k"
    assert lines[2].split()[-1] == "-" and lines[3].split()[-1] == "15.0"
