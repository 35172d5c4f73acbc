"""The closed loop in the placement core (``router.placement.loop``): a flight carries what its
placement predicted into the Observation its answer is judged by, and a worker whose reports
disagree is scored from its approximate tree until they agree again, the others untouched. A
real index fed real events, a real worker table, a controlled clock; the loop's switch is the
index itself (no subscriber here: this test is the index's one writer)."""

from __future__ import annotations

from typing import Any

import pytest

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from router.fleet.registry import Registry
from router.placement import PlacementSettings, Placer
from router.placement.agreement import INDEX_AHEAD, WORKER_AHEAD
from router.placement.loop import observation
from router.settings import WorkerConfig, load_settings

BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


class Turns:
    """Records the loop's metric calls (the real RouterMetrics is tested over sockets)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def agreement(self, worker: str, reason: str, disagrees: bool) -> None:
        self.calls.append((worker, reason, disagrees))


def build(hold_s: float = 0.0, **agreement: Any) -> tuple[Placer, Clock, Turns]:
    overrides = {
        "workers": [],
        "block_size": BS,
        "agreement": {"hold_s": hold_s, "min_requests": 8, **agreement},
    }
    settings = load_settings(environ={}, overrides=overrides)
    clock = Clock()
    fleet = Registry(settings.health, clock=clock)
    index = PrefixIndex(BS)
    for wid in ("a", "b"):
        fleet.add(WorkerConfig(id=wid, url=f"http://{wid}.invalid", events_endpoint="tcp://x:1"))
        index.add_worker(wid, 0)
    turns = Turns()
    placer = Placer(PlacementSettings.of(settings), index, fleet, metrics=turns, clock=clock)
    return placer, clock, turns


def store(placer: Placer, worker: str, tokens: list[int]) -> None:
    n = len(tokens) // BS
    # engine hashes of the prompt's own (any stable function of the prefix will do)
    engine = [hash(tuple(tokens[: (i + 1) * BS])) & 0xFFFFFFF for i in range(n)]
    ev = BlockStored(engine, None, tokens[: n * BS], BS)
    placer.index.apply_event((worker, 0), ev)


def answer(placer: Placer, prompt: list[int], cached: int, worker: str) -> None:
    d = placer.place(prompt)
    i = next(j for j, c in enumerate(d.candidates) if c.key == (worker, 0))
    f = placer.fly(d, i, "proxy")
    f.cached = cached
    f.done("200")


def test_a_flight_carries_its_placement_into_the_observation() -> None:
    placer, _, _ = build()
    prompt = list(range(100, 100 + 8 * BS + 3))
    store(placer, "a", prompt[: 5 * BS])
    d = placer.place(prompt)
    i = next(j for j, c in enumerate(d.candidates) if c.key == ("a", 0))
    f = placer.fly(d, i, "proxy")
    assert observation(f) is None  # no report yet
    f.cached = 5 * BS
    obs = observation(f, engine_block_size=32)
    assert obs is not None
    assert (obs.worker, obs.prompt_tokens, obs.block_size) == ("a", 8 * BS + 3, BS)
    assert dict(obs.by_tier) == {"GPU": 5} and obs.predicted_blocks == 0
    assert (obs.reported_tokens, obs.engine_block_size) == (5 * BS, 32)
    # the decode leg of a remote pick: its KV was transferred, its report says nothing
    f2 = placer.fly(d, i, "proxy", leg="decode")
    f2.cached = 0
    assert observation(f2) is None


def test_a_worker_reporting_nothing_is_turned_approximate_and_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    placer, _, turns = build()
    loop = placer.loop
    prompts = [list(range(1000 * k, 1000 * k + 6 * BS)) for k in range(1, 40)]
    for p in prompts:  # both workers' events say they hold every prompt
        store(placer, "a", p)
        store(placer, "b", p)
    for p in prompts[:8]:
        answer(placer, p, 5 * BS, "b")  # b agrees: it reuses what its events said
        answer(placer, p, 0, "a")  # a reuses nothing (prefix caching off, a restart)
    assert turns.calls == [("a", INDEX_AHEAD, True)]
    # named once, with after how many of its answers (the 8th: min_requests)
    named = [r.getMessage() for r in caplog.records if "disagree with the index" in r.message]
    assert len(named) == 1 and "worker a:" in named[0] and "its answer 8)" in named[0]
    assert placer.index.approximate(("a", 0)) and not placer.index.approximate(("b", 0))
    view = loop.verdict("a")
    assert view["scoring"] == "approximate" and view["kind"] == INDEX_AHEAD
    assert "reuses nothing" in str(view["likely"])
    assert loop.verdict("b")["scoring"] == "events" and loop.verdict("b")["agrees"]
    # its events are ignored now; what the router sends it is its tree
    assert placer.index.worker(("a", 0)).entries() == 0
    store(placer, "a", prompts[9])
    assert placer.index.worker(("a", 0)).entries() == 0
    # the worker caches again: its reports agree with the tree of what it was sent
    k = 10
    while placer.index.approximate(("a", 0)):
        p = prompts[k % len(prompts)]
        answer(placer, p, 0, "a")  # first send: nothing cached there, nothing predicted
        answer(placer, p, 5 * BS, "a")  # the tree predicts it, the worker reuses it
        k += 1
        assert k < 80, "never went back to its events"
    assert turns.calls[-1] == ("a", INDEX_AHEAD, False)
    assert loop.verdict("a")["scoring"] == "events" and loop.verdict("a")["requests"] == 0


def lost_stores(placer: Placer, clock: Clock, p: list[int]) -> None:
    """Two answers for ``p`` on ``a``, the router's prediction expired in between: its events
    never show the blocks the second one reuses."""
    answer(placer, p, 0, "a")
    clock.t += placer.predicted.ttl_s + 1
    placer.housekeeping()
    answer(placer, p, 5 * BS, "a")


def test_a_hold_keeps_a_worker_approximate_and_doubles_each_time() -> None:
    placer, clock, turns = build(hold_s=1000.0, window=16)
    loop = placer.loop
    prompts = [list(range(1000 * k, 1000 * k + 6 * BS)) for k in range(1, 60)]
    for p in prompts[:8]:
        lost_stores(placer, clock, p)
    assert turns.calls == [("a", WORKER_AHEAD, True)]
    assert "never matched" in str(loop.verdict("a")["likely"])
    for p in prompts[8:40]:  # the tree agrees (the turning answers left the window), held
        lost_stores(placer, clock, p)
    assert placer.index.approximate(("a", 0)) and loop.estimator.verdict("a").agrees
    clock.t += 1000  # the hold is over, and the answers that judged the tree too old to count
    k = 40
    while placer.index.approximate(("a", 0)):  # back once enough recent answers agree
        lost_stores(placer, clock, prompts[k])
        k += 1
    assert k == 48 and turns.calls[-1][2] is False
    for p in prompts[k : k + 8]:  # still lost: turned again, held twice as long
        lost_stores(placer, clock, p)
    assert turns.calls[-1] == ("a", WORKER_AHEAD, True) and loop.trips["a"] == 2
    assert loop.turned["a"][1] - clock.t > 1000  # (it turned less than 1000 s ago)


def test_a_worker_without_events_is_never_switched() -> None:
    placer, _, turns = build()
    placer.index.set_approximate(("a", 0))
    for k in range(1, 20):
        answer(placer, list(range(1000 * k, 1000 * k + 6 * BS)), 5 * BS, "a")
    assert turns.calls == [] and placer.index.approximate(("a", 0))


def test_the_loop_off_judges_nothing() -> None:
    placer, _, turns = build(enabled=False)
    for k in range(1, 20):
        answer(placer, list(range(1000 * k, 1000 * k + 6 * BS)), 5 * BS, "a")
    assert turns.calls == [] and placer.loop.estimator.workers() == []


def test_lost_stores_keep_what_the_events_held_as_the_trees_seed() -> None:
    # worker_ahead: the events were true, only incomplete; an empty tree would forget them
    placer, clock, turns = build(hold_s=1000.0)
    held = list(range(500, 500 + 6 * BS))
    store(placer, "a", held)
    hashes = placer.index.request_hashes(held)
    for k in range(1, 9):
        lost_stores(placer, clock, list(range(1000 * k, 1000 * k + 6 * BS)))
    assert turns.calls == [("a", WORKER_AHEAD, True)]
    assert placer.index.approximate(("a", 0))
    assert placer.index.match(hashes).workers[("a", 0)].matched_blocks == 6
    view = placer.loop.verdict("a")
    assert (view["scoring"], view["agrees"], view["kind"]) == ("approximate", False, WORKER_AHEAD)


def test_a_worker_whose_events_never_show_what_it_was_sent_is_named() -> None:
    # another hash seed: its events store every prompt, under keys the router never computes,
    # so nothing is ever predicted or matched there and every answer alone says nothing
    placer, _, turns = build()
    for k in range(1, 20):
        p = list(range(1000 * k, 1000 * k + 6 * BS))
        d = placer.place(p)
        f = placer.fly(d, next(j for j, c in enumerate(d.candidates) if c.key == ("a", 0)), "x")
        store(placer, "a", [t + 1_000_000 for t in p])  # (its own seed: other keys)
        f.cached = 0
        f.done("200")
        if turns.calls:
            break
    assert turns.calls == [("a", WORKER_AHEAD, True)] and k == 8
    assert "never showed" in str(placer.loop.verdict("a")["likely"])


def test_a_worker_whose_events_said_nothing_since_is_not_judged_by_them() -> None:
    # late events, or a worker that stores nothing: no evidence either way
    placer, _, turns = build()
    for k in range(1, 20):
        answer(placer, list(range(1000 * k, 1000 * k + 6 * BS)), 0, "a")
    assert turns.calls == [] and placer.loop.estimator.verdict("a").requests == 0
