"""vllm-router 0.1.17 (``--vllm-pd-disaggregation``) in front of a bundled prefill/decode pair:
vLLM's own router drives the engines' NIXL-pull exchange (prefill leg with ``max_tokens`` 1 and
``kv_transfer_params``, the answer's params to the decode leg), so every request, chat or
completion, streamed or not, goes through a real pull and ends the prefill engine's lease.

Needs the ``vllm-router`` binary, named by ``KVROUTER_VLLM_ROUTER_BIN`` (the CI stage installs
it in its own venv: see ``.ci/run``); never a dependency of this project.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from kvrouter.replay.fleet import FleetSpec
from kvrouter.replay.live import LiveTargets, run_policy
from kvrouter.replay.live_client import LiveRequest
from tests.unit.engine.pd_helpers import engines
from tests.waiting import poll

SIM = ["--speedup", "10"]
PROMPT = "Why split prefill from decode? " * 4


def _bin() -> str:
    exe = os.environ.get("KVROUTER_VLLM_ROUTER_BIN")
    assert exe, "set KVROUTER_VLLM_ROUTER_BIN to vllm-router 0.1.17's binary"
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("policy", ["round_robin", "kv_aware"])
def test_vllm_router_drives_the_bundled_pd_pair(tmp_path: Path, policy: str) -> None:
    with engines(["--role", "prefill", *SIM], ["--role", "decode", *SIM]) as (p, d):
        port = _free_port()
        cmd = [_bin(), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
        cmd += ["--prefill", p.url, "--decode", d.url, "--policy", policy]
        if policy == "kv_aware":  # its prefill pick from the prefill engine's KV events
            cmd += ["--pd-kv-events", f"{p.url}={p.events}"]
        with open(tmp_path / "vllm-router.log", "w") as log:
            router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            poll(lambda: _up(url) or router.poll() is not None, 60, "vllm-router up")
            assert router.poll() is None, (tmp_path / "vllm-router.log").read_text()
            chat = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0}
            chat |= {"model": "kvrouter-sim", "max_tokens": 8}
            answers = [
                httpx.post(url + "/v1/chat/completions", json=chat, timeout=60),
                httpx.post(url + "/v1/chat/completions", json=chat | {"stream": True}, timeout=60),
                httpx.post(
                    url + "/v1/completions",
                    json={"model": "kvrouter-sim", "prompt": PROMPT, "max_tokens": 8},
                    timeout=60,
                ),
            ]
        finally:
            router.terminate()
            router.wait(10)
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
        assert "data: [DONE]" in answers[1].text
        whole = p.post(chat, path="/v1/chat/completions").json()["choices"][0]["message"]
        assert answers[0].json()["choices"][0]["message"]["content"] == whole["content"]
        side, p_side = d.transfers(), p.transfers()
        assert side["pulls"] == {"pulled": 3, "failed": 0, "recomputed": 0}
        assert side["loaded_blocks"] > 0
        assert p_side["served"] == 3 and p_side["leases"]["held"] == 0


@pytest.mark.parametrize("policy", ["round_robin", "kv_aware"])
def test_vllm_router_drives_a_live_pd_replay(tmp_path: Path, policy: str) -> None:
    """``kvrouter replay --mode live --pd 1:2 --policies vllm-router``: its PD mode over a fresh
    fleet of one prefill and two decode engines; every request pulled, none failed."""
    first = [f"conversation {c}: " + chr(65 + c) * 300 for c in range(4)]
    reqs = [LiveRequest(0.05 * c, lambda p=p: p, 2) for c, p in enumerate(first)]
    reqs += [
        LiveRequest(3.0 + 0.05 * c, lambda p=p: p + " and?" * 8, 2) for c, p in enumerate(first)
    ]
    spec = FleetSpec(block_size=16, gpu_blocks=1024, speedup=10.0, ready_timeout=90, pd=(1, 2))
    targets = LiveTargets(fleet=spec, vllm_router_bin=_bin(), vllm_router_policy=policy)
    with open(tmp_path / "children.log", "w") as log:
        run = run_policy("vllm-router", reqs, targets, speedup=2.0, log=log)
    for o in run.outcomes:
        assert o.error is None, (o.error, (tmp_path / "children.log").read_text()[-2000:])
    assert run.policy == f"vllm-router 1:2 {policy}"
    assert run.engines[0].requests == 8 and sum(e.requests for e in run.engines) == 16
    assert (run.extra["remote_%"], run.extra["pulls"], run.extra["pull_fail"]) == (100.0, 8, "0")
    if policy == "kv_aware":  # the second turns' heads were on the (one) prefill engine
        assert run.extra["P_hit_%"] > 20
