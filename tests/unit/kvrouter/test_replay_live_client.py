"""Live replay's client side on real loopback servers: the client-side policies, the streamed
request (first-token time, usage), errors recorded rather than raised, and CPU time from /proc."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator

import pytest

from engine.config import EngineConfig, ServerSettings
from engine.server import create_app
from kvrouter.replay.fleet import cpu_seconds
from kvrouter.replay.live import add_live_arguments, targets_from_args
from kvrouter.replay.live_client import ClientPolicy, LiveRequest, drive
from tests.unit.engine.engine_helpers import serve


@pytest.fixture
async def engines() -> AsyncIterator[list[str]]:
    settings = ServerSettings(engine=EngineConfig(speedup=100.0), events=None, replay=None)
    async with serve(create_app(settings)) as a, serve(create_app(settings)) as b:
        yield [a, b]


def test_round_robin_alternates_and_least_load_takes_the_idle_worker() -> None:
    rr = ClientPolicy("round_robin", ["a", "b", "c"])
    assert [rr.pick() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = ClientPolicy("least_load", ["a", "b", "c"])
    ll.outstanding = [3, 1, 2]
    assert ll.pick() == 1
    ll.outstanding = [0, 0, 0]  # ties rotate instead of piling on the first worker
    assert {ll.pick() for _ in range(3)} == {0, 1, 2}
    picks = [ClientPolicy("random", ["a", "b"], seed=7).pick() for _ in range(2)]
    assert picks[0] == picks[1]  # seeded
    with pytest.raises(ValueError, match="unknown client-side policy"):
        ClientPolicy("kvrouter", ["a"])


async def test_drive_streams_reads_usage_and_spreads_by_policy(engines: list[str]) -> None:
    shared = "S" * 64
    reqs = [
        LiveRequest(i * 0.01, lambda i=i: shared + f"request {i} " * 8, max_tokens=3 + i)
        for i in range(6)
    ]
    done: list[int] = []
    policy = ClientPolicy("round_robin", engines)
    # two drives: each worker's first request has finished (its prefix is cached) before the
    # other four start, however slow the machine; the policy carries on its rotation
    out = [
        o
        for part in (reqs[:2], reqs[2:])
        for o in await drive(
            part,
            speedup=1.0,
            model="kvrouter-sim",
            policy=policy,
            on_done=lambda o: done.append(o.index),
        )
    ]
    assert sorted(done) == [0, 0, 1, 1, 2, 3]
    assert [o.worker for o in out] == [engines[i % 2] for i in range(6)]
    for o, r in zip(out, reqs):
        assert o.error is None, o.error
        assert o.prompt_tokens == len(r.prompt()) and o.output_tokens == r.max_tokens
        assert o.ttft_s is not None and o.e2e_s is not None and 0 < o.ttft_s <= o.e2e_s
    # the shared 64 characters are 4 cached blocks on each worker after its first request
    assert [o.cached_tokens for o in out] == [0, 0, 64, 64, 64, 64]


async def test_errors_are_recorded_per_request(engines: list[str]) -> None:
    reqs = [LiveRequest(0.0, lambda: "x" * 40000, 1), LiveRequest(0.0, lambda: "ok", 1)]
    out = await drive(reqs, speedup=1.0, model="kvrouter-sim", router=engines[0])
    assert out[0].error is not None and out[0].error.startswith("HTTP 400")
    assert out[1].error is None and out[1].output_tokens == 1
    closed = await drive(reqs[1:], speedup=1.0, model="m", router="http://127.0.0.1:9")
    assert closed[0].error is not None and "ConnectError" in closed[0].error


def test_arrivals_are_paced_by_the_speedup() -> None:
    sent: list[float] = []

    def prompt() -> str:
        sent.append(time.monotonic())
        return "p"

    reqs = [LiveRequest(t, prompt, 1) for t in (0.0, 0.4, 0.8)]
    asyncio.run(drive(reqs, speedup=4.0, model="m", router="http://127.0.0.1:9"))
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert min(gaps) >= 0.09 and sent[-1] - sent[0] < 0.5, gaps  # 0.4 s of trace at 4x = 0.1 s


def test_cpu_seconds_reads_proc() -> None:
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # burn some CPU so there is something to read
        pass
    # (read between two os.times(): another thread of this test process may burn CPU meanwhile)
    before = os.times()
    got = cpu_seconds(os.getpid())
    after = os.times()
    assert got is not None
    assert before.user + before.system - 0.02 <= got <= after.user + after.system + 0.02
    assert cpu_seconds(2**22 + 12345) is None  # no such process


def test_live_options_pick_a_fleet_or_the_given_servers() -> None:
    p = argparse.ArgumentParser()
    add_live_arguments(p)
    shape = {"workers": 4, "block_size": 16, "gpu_blocks": 512, "speedup": 2.0}
    t = targets_from_args(p.parse_args(["--router-env", "KVROUTER_A=x=1"]), **shape)
    assert t.fleet is not None and t.fleet.workers == 4 and t.fleet.speedup == 2.0
    assert t.router_env == {"KVROUTER_A": "x=1"}
    argv = ["--worker-url", "http://a", "--worker-url", "http://b", "--router-url", "http://r"]
    t = targets_from_args(p.parse_args(argv), **shape)
    assert t.fleet is None and t.worker_urls == ("http://a", "http://b")
    assert t.router_url == "http://r"
    with pytest.raises(SystemExit):
        p.parse_args(["--router-env", "NOVALUE"])
