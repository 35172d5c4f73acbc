"""Faults in the virtual replay (issue 36, :mod:`kvrouter.replay.faults`): each answer reports the
engine's real prefix-cache hit, so the closed loop runs as in the router. A worker hashing with
another seed is named (worker ahead, the hash seed among the likely causes) and scored from its
approximate tree; with the loop off nobody is; without faults every worker agrees. The faulty
path itself: dropped events, salted stores and a silent restart."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sequence import Request
from indexer.events import AllBlocksCleared, BlockStored
from kvrouter.replay.faults import FaultInjector, Faults, add_fault_arguments, faults_of
from kvrouter.replay.trace import SharedPrefixSpec, shared_prefix
from kvrouter.replay.virtual import VirtualFleet, VirtualRun, run_virtual

TB = 64
# 32 conversations of 6 turns on 2 workers: each comes back after its predictions expired
SPEC = SharedPrefixSpec(
    groups=32, prompts=1, system_len=1024, question_len=64, output_len=8, turns=6, rate=8.0,
    think_s=5.0,
)  # fmt: skip


def _run(faults: Faults) -> VirtualRun:
    fleet = VirtualFleet(workers=2, block_size=16, gpu_blocks=2048, faults=faults)
    return run_virtual(shared_prefix(SPEC, TB), "kvrouter", fleet, trace_block=TB)


def test_a_worker_with_another_hash_seed_is_named_and_switched() -> None:
    run = _run(Faults(seed_k=1))
    assert run.loop is not None
    turned = [t for t in run.loop.turns if t[1]]
    assert {t[0] for t in turned} == {"w1"}  # the faulty one and nobody else
    _, _, answers, kind, likely, _ = turned[0]
    assert kind == "worker_ahead" and "hash seed" in likely
    # not before the estimate's minimum, and soon: here after 8, each of whose prompts its events
    # (announcing stores all along) never showed by its end
    assert 8 <= answers <= 60 and "never showed" in likely
    # scored from its tree for its hold (30 s) at least before a probation on its events
    back = [t for t in run.loop.turns if not t[1]]
    assert all(b[5] - turned[0][5] >= 30.0 for b in back[:1])
    assert run.loop.verdicts["w0"]["scoring"] == "events" and run.loop.verdicts["w0"]["agrees"]
    assert run.policy == "kvrouter [seed x1; loop on]"
    assert run.extra["turned"].startswith("w1@")


def test_with_the_loop_off_nobody_is_switched() -> None:
    run = _run(Faults(seed_k=1, loop=False))
    assert run.loop is not None
    assert run.loop.turns == [] and run.extra["turned"] == "-"
    assert run.loop.answers["w1"] > 0  # the answers reported their hits all the same
    assert all(v["scoring"] == "events" and v["requests"] == 0 for v in run.loop.verdicts.values())
    assert run.policy == "kvrouter [seed x1; loop off]"


def test_without_faults_every_worker_agrees() -> None:
    run = _run(Faults())
    assert run.loop is not None and run.loop.turns == []
    assert set(run.loop.verdicts) == {"w0", "w1"}
    for v in run.loop.verdicts.values():
        assert v["agrees"] and v["requests"] >= 8 and v["counts"]["agree"] == v["requests"]
    # the reports are the engines' real hits, whole blocks
    hits = [o.cached_tokens for o in run.outcomes]
    assert any(hits) and all(h % 16 == 0 for h in hits)
    assert run.policy == "kvrouter"


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(block_size=16, num_gpu_blocks=64))


def test_the_faulty_path() -> None:
    store = BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=list(range(16)), block_size=16
    )
    inj = FaultInjector(Faults(drop_p=1.0, drop_k=1, seed_k=1), 3, restart_at=5.0, seed=0)
    assert inj.events(0, [store], 1.0) == [store]  # a healthy worker's go through
    assert inj.events(2, [store, store], 1.0) == [] and inj.dropped[2] == 2
    (salted,) = FaultInjector(Faults(seed_k=1), 3, 5.0, 0).events(2, [store], 1.0)
    assert isinstance(salted, BlockStored) and salted.block_hashes == [1]
    assert set(salted.token_ids).isdisjoint(store.token_ids)

    # a fresh stream: what reached the router by then, the true log (no drops), its own seed
    late = BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=[7] * 16, block_size=16)
    inj.events(2, [late], 3.0)
    assert inj.replay(0, 2.0) == [store]
    replayed = inj.replay(2, 2.0)  # the two it lost on the way, both there
    assert len(replayed) == 2
    assert all(isinstance(e, BlockStored) and e.token_ids == salted.token_ids for e in replayed)
    assert len(inj.replay(2, 3.0)) == 3

    engines = [_engine(), _engine()]
    for e in engines:
        e.add_request(Request("a", list(range(40)), 1, ignore_eos=True))
        while e.has_work:
            e.step()
        e.drain_events()
    restart = FaultInjector(Faults(restart_k=1), 2, restart_at=5.0, seed=0)
    restart.events(1, [store], 1.0)
    restart.arrive(4.0, engines)  # not yet
    assert all(e.bm.lookup(e.bm.hash_blocks_of(list(range(32)))) for e in engines)
    restart.arrive(5.0, engines)
    assert engines[0].bm.lookup(engines[0].bm.hash_blocks_of(list(range(32))))
    assert not engines[1].bm.lookup(engines[1].bm.hash_blocks_of(list(range(32))))
    assert not any(isinstance(ev, AllBlocksCleared) for ev in engines[1].drain_events())
    assert restart.replay(1, 9.0) == []  # a restarted publisher holds nothing from before


def test_the_flags() -> None:
    p = argparse.ArgumentParser()
    add_fault_arguments(p)
    p.add_argument("--workers", type=int, default=8)
    f = faults_of(p.parse_args(["--fault-drop", "0.2:2", "--fault-seed", "1", "--loop", "off"]))
    assert f == Faults(drop_p=0.2, drop_k=2, seed_k=1, loop=False)
    assert f.label() == " [drop 20% x2, seed x1; loop off]"
    assert f.label(router=False) == " [drop 20% x2, seed x1]"  # (no loop but the router's)
    assert faults_of(p.parse_args([])).label() == ""
    assert Faults(loop=False).label(router=False) == ""
    for bad in (["--fault-drop", "0.2"], ["--fault-drop", "2:1"], ["--fault-seed", "9"]):
        with pytest.raises(ValueError):
            faults_of(p.parse_args(bad))
