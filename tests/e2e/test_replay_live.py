"""Live replay end to end: a tiny multi-turn trace through a fresh fleet of real subprocesses
(two sim engines publishing KV events, and kvrouter in front of them) and through the client-side
round robin on another fresh fleet; what each request saw, the engines' counters, router CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvrouter.replay.fleet import TPOT, FleetSpec
from kvrouter.replay.live import LiveTargets, run_policy
from kvrouter.replay.live_client import LiveRequest

pytestmark = pytest.mark.slow

BS = 16


def _trace() -> list[LiveRequest]:
    """Three conversations; each second turn extends its first (arrives 2 s later, wall clock)."""
    first = [f"conversation {c}: " + chr(65 + c) * 300 for c in range(3)]
    reqs = [LiveRequest(0.05 * c, lambda p=p: p, 2) for c, p in enumerate(first)]
    reqs += [
        LiveRequest(4.0 + 0.05 * c, lambda p=p: p + " and then?" * 5, 2)
        for c, p in enumerate(first)
    ]
    return reqs


@pytest.mark.parametrize("policy", ["kvrouter", "round_robin"])
def test_live_run_on_a_fresh_fleet(policy: str, tmp_path: Path) -> None:
    spec = FleetSpec(workers=2, gpu_blocks=1024, block_size=BS, speedup=10.0, ready_timeout=90)
    reqs = _trace()
    with open(tmp_path / "children.log", "w") as log:
        run = run_policy(policy, reqs, LiveTargets(fleet=spec), speedup=2.0, log=log)
    out = run.outcomes
    for o, r in zip(out, reqs):
        assert o.error is None, (o.error, (tmp_path / "children.log").read_text()[-2000:])
        assert o.prompt_tokens == len(r.prompt()) and o.output_tokens == 2
        assert o.ttft_s is not None and o.e2e_s is not None and o.ttft_s <= o.e2e_s
    assert len(run.engines) == 2 and sum(e.requests for e in run.engines) == len(reqs)
    assert sum(e.preemptions for e in run.engines) == 0
    if policy == "kvrouter":
        # every second turn goes where its first turn's blocks are, and reuses all of them
        for first, second in zip(out[:3], out[3:]):
            assert second.worker == first.worker and second.worker in ("engine-0", "engine-1")
            assert second.cached_tokens >= first.prompt_tokens // BS * BS > 0
        assert run.router_cpu_s is not None and run.router_cpu_s > 0
    else:
        # the client alternates: turn 2 of conversation c lands on the other worker from turn 1
        assert [o.worker for o in out] == [o.worker for o in out[:2]] * 3
        assert all(o.cached_tokens == 0 for o in out[:3]) and run.router_cpu_s is None
        assert [e.requests for e in run.engines] == [3, 3]


def test_live_pd_fleet_pulls_every_prompt_and_reports_its_counters(tmp_path: Path) -> None:
    """``--pd 1:1 --pd-mode always``: every request's prompt computed on the prefill engine and
    pulled by the decode engine (the sim checks every pulled block's payload), the second turns
    finding their first turns' blocks on the prefill engine, the PD columns from its counters."""
    spec = FleetSpec(block_size=BS, gpu_blocks=1024, speedup=10.0, ready_timeout=90, pd=(1, 1))
    reqs = _trace()
    targets = LiveTargets(fleet=spec, pd_mode="always")
    with open(tmp_path / "children.log", "w") as log:
        run = run_policy("kvrouter", reqs, targets, speedup=2.0, log=log)
    for o in run.outcomes:
        assert o.error is None, (o.error, (tmp_path / "children.log").read_text()[-2000:])
        assert o.output_tokens == 2 and o.worker == "decode-0"
        assert (o.pd, o.prefill_worker) == ("remote", "prefill-0")  # (the router's headers)
    assert run.policy == "kvrouter 1:1 always"
    assert [(e.role, e.requests) for e in run.engines] == [("prefill", 6), ("decode", 6)]
    extra = run.extra
    assert (extra["remote_%"], extra["pulls"], extra["pull_fail"]) == (100.0, 6, "0")
    assert extra["P_hit_%"] > 20  # the second turns' heads, cached on the prefill engine
    assert run.engines[1].pd["kvrouter_engine_pd_pulled_bytes_total"] > 0
    # the decode engine timed its 6 streams itself (the client's TPOT less the router's hop)
    assert run.engines[1].pd[f"{TPOT}_count"] == 6 and extra["eng_tpot_ms"] > 0


#: not KVROUTER_...: the fleet's router reads those as its own settings
SMG_PYTHON = os.environ.get("SMG_PYTHON", "")


@pytest.mark.skipif(
    not SMG_PYTHON,
    reason="set SMG_PYTHON to a Python with smg installed (python3 -m venv /tmp/smg && "
    "/tmp/smg/bin/pip install smg==1.13.0)",
)
def test_smg_starts_and_routes_twenty_requests(tmp_path: Path) -> None:
    """smg 1.13 (SGLang's gateway) as the fleet's router: it registers both engines, routes 20
    streamed requests, and sends each second turn where its first turn went (a full match)."""
    spec = FleetSpec(workers=2, gpu_blocks=1024, block_size=BS, speedup=10.0, ready_timeout=90)
    first = [f"conversation {c}: " + chr(65 + c) * 300 for c in range(10)]
    reqs = [LiveRequest(0.05 * c, lambda p=p: p, 2) for c, p in enumerate(first)]
    reqs += [
        LiveRequest(4.0 + 0.05 * c, lambda p=p: p + " and then?" * 5, 2)
        for c, p in enumerate(first)
    ]
    targets = LiveTargets(fleet=spec, smg_python=SMG_PYTHON)
    with open(tmp_path / "children.log", "w") as log:
        run = run_policy("smg", reqs, targets, speedup=2.0, log=log)
    out = run.outcomes
    for o in out:
        assert o.error is None, (o.error, (tmp_path / "children.log").read_text()[-2000:])
        assert o.ttft_s is not None and o.output_tokens == 2
    assert sum(e.requests for e in run.engines) == 20
    for a, b in zip(out[:10], out[10:]):
        assert b.worker == a.worker and b.cached_tokens >= a.prompt_tokens // BS * BS > 0
    assert run.router_cpu_s is not None and run.router_cpu_s > 0


@pytest.mark.skipif(not SMG_PYTHON, reason="set SMG_PYTHON (see above)")
def test_smg_pd_mode_sends_each_request_whole_to_both_engines(tmp_path: Path) -> None:
    """smg 1.13 in its PD mode (``--pd-disaggregation --backend vllm``) in front of a bundled
    prefill/decode pair: over HTTP it speaks SGLang's bootstrap exchange, not vLLM's NIXL one,
    so each request goes whole (its own ``max_tokens``, no ``kv_transfer_params``) to a prefill
    and a decode engine at once: both compute the prompt, no lease is opened, nothing is pulled.
    (What docs/replay.md's live PD table measures for smg.)"""
    spec = FleetSpec(block_size=BS, gpu_blocks=1024, speedup=10.0, ready_timeout=90, pd=(1, 1))
    targets = LiveTargets(fleet=spec, smg_python=SMG_PYTHON)
    with open(tmp_path / "children.log", "w") as log:
        run = run_policy("smg", _trace(), targets, speedup=2.0, log=log)
    for o in run.outcomes:
        assert o.error is None, (o.error, (tmp_path / "children.log").read_text()[-2000:])
        assert o.output_tokens == 2
    assert run.policy == "smg 1:1"
    pre, dec = run.engines
    assert (pre.requests, dec.requests) == (6, 6) and pre.prompt_tokens == dec.prompt_tokens
    assert pre.pd["kvrouter_engine_pd_leases_opened_total"] == 0
    assert (run.extra["pulls"], run.extra["pull_fail"]) == (0, "0")
