"""sglang-router 0.3.2 (``--policy cache_aware``) in front of two bundled engines, as live replay
runs it: it registers both under the served model (``/model_info``), streams completions with
usage, and sends a conversation's second turn to the worker that holds its first.

Needs a Python with ``sglang-router`` installed, named by ``KVROUTER_SGLANG_PYTHON`` (the CI stage
makes one: see ``.ci/run``); never a dependency of this project.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from kvrouter.replay.fleet import Fleet, FleetSpec
from kvrouter.replay.live import LiveTargets, run_policy
from kvrouter.replay.live_client import LiveRequest

BS = 16


def _python() -> str:
    python = os.environ.get("KVROUTER_SGLANG_PYTHON")
    assert python, "set KVROUTER_SGLANG_PYTHON to a Python with sglang-router installed"
    return python


def test_sglang_router_registers_the_engines_under_their_model(tmp_path: Path) -> None:
    spec = FleetSpec(workers=2, gpu_blocks=1024, speedup=10.0, ready_timeout=90)
    with open(tmp_path / "children.log", "w") as log, Fleet(spec, log=log) as fleet:
        url = fleet.start_sglang_router(_python())
        workers = httpx.get(url + "/workers", timeout=10).json()["workers"]
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.engine_urls)
    assert {w["model_id"] for w in workers} == {"kvrouter-sim"}
    assert [m["id"] for m in models] == ["kvrouter-sim"]


def test_cache_aware_keeps_a_conversation_on_its_worker(tmp_path: Path) -> None:
    first = [f"conversation {c}: " + chr(65 + c) * 400 for c in range(4)]
    reqs = [LiveRequest(0.05 * c, lambda p=p: p, 2) for c, p in enumerate(first)]
    reqs += [LiveRequest(2 + 0.05 * c, lambda p=p: p + " more" * 9, 2) for c, p in enumerate(first)]
    spec = FleetSpec(workers=2, gpu_blocks=1024, speedup=10.0, ready_timeout=90)
    targets = LiveTargets(fleet=spec, sglang_python=_python())
    with open(tmp_path / "children.log", "w") as log:
        run = run_policy("sglang", reqs, targets, speedup=2.0, log=log)
    assert all(o.error is None for o in run.outcomes), [o.error for o in run.outcomes]
    for one, two in zip(run.outcomes[:4], run.outcomes[4:]):
        assert two.cached_tokens >= one.prompt_tokens // BS * BS > 0
    # (all eight may land on one worker: at idle, 0.3.2 sends unrelated prompts to the same one)
    assert sum(e.requests for e in run.engines) == 8
    # read from /proc in clock ticks (10 ms): a Rust router may spend less than one on 8 requests
    assert run.router_cpu_s is not None and run.router_cpu_s >= 0
