"""``kvrouter replay --mode live`` with policy ``kvrouter-epp``: the router as an endpoint picker
behind a real Envoy (``KVROUTER_ENVOY_BIN``), next to policy ``kvrouter`` (proxy mode) in one
run, each on a fresh fleet of two bundled engines. The table has both rows, every request
served, the same routing quality, and Envoy's CPU beside the router's.

    KVROUTER_ENVOY_BIN=.venv-envoy/envoy/_bin/envoy python -m pytest -q tests/stages/envoy
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ENVOY_BIN = os.environ.get("KVROUTER_ENVOY_BIN", "")
pytestmark = pytest.mark.skipif(
    not ENVOY_BIN, reason="KVROUTER_ENVOY_BIN is not set (.ci/envoy.sh installs Envoy and sets it)"
)


def test_a_live_replay_compares_proxy_mode_and_epp_mode_in_one_table(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    argv = [
        sys.executable, "-m", "kvrouter", "replay", "--mode", "live",
        "--workload", "shared-prefix", "--groups", "2", "--prompts", "10", "--count", "20",
        "--system-len", "1024", "--question-len", "64", "--output-len", "16", "--rate", "20",
        "--workers", "2", "--gpu-blocks", "4096", "--policies", "kvrouter,kvrouter-epp",
        "--no-progress", "--json", str(out), "--children-log", str(tmp_path / "children.log"),
    ]  # fmt: skip
    # the binary comes from the variable (no --envoy-bin), which the routers must not see
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["KVROUTER_ENVOY_BIN"] = ENVOY_BIN
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr + _tail(tmp_path / "children.log")
    assert "envoy_cpu_s/1k" in done.stdout
    rows = {r["policy"]: r for r in json.loads(out.read_text())["table"]}
    proxy, epp = rows["kvrouter"], rows["kvrouter-epp"]
    for r in (proxy, epp):
        assert (r["ok"], r["errors"]) == (20, 0), r
        assert r["of_ideal_%"] >= 90, r  # each group's prefix stays on one worker
        assert r["cpu_s/1k"] is not None and r["cpu_s/1k"] > 0, r
    assert "envoy_cpu_s/1k" not in proxy
    assert epp["envoy_cpu_s/1k"] > 0, epp


def _tail(path: Path) -> str:
    return path.read_text()[-4000:] if path.exists() else ""
