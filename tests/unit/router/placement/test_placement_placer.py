"""``router.placement.Placer`` alone — a real index fed real events, a real worker table, no
metrics, a controlled clock: what the replay builds, and what every front door calls."""

from __future__ import annotations

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from router.fleet.registry import Registry
from router.placement import NO_METRICS, Placer, TicketState
from router.settings import WorkerConfig, load_settings

BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def build(workers: tuple[str, ...] = ("a", "b", "c")) -> tuple[Placer, Clock]:
    settings = load_settings(environ={}, overrides={"workers": [], "block_size": BS})
    clock = Clock()
    fleet = Registry(settings.health, clock=clock)
    index = PrefixIndex(BS)
    for wid in workers:
        fleet.add(WorkerConfig(id=wid, url=f"http://{wid}.invalid", events_endpoint="tcp://x:1"))
        index.add_worker(wid, 0)
    return Placer(settings, index, fleet, metrics=NO_METRICS, clock=clock), clock


def store(placer: Placer, worker: str, tokens: list[int]) -> None:
    n = len(tokens) // BS
    ev = BlockStored(list(range(1, n + 1)), None, tokens[: n * BS], BS)
    placer.index.apply_event((worker, 0), ev)


def test_the_worker_holding_the_prefix_wins_and_its_flight_ends_once() -> None:
    placer, _ = build()
    prompt = list(range(100, 100 + 8 * BS))
    store(placer, "b", prompt)
    d = placer.place(prompt)
    best = d.candidates[d.order[0]]
    assert best.key == ("b", 0) and best.matched_blocks == 8 and d.n == 8
    f = placer.fly(d, d.order[0], "proxy")
    ld = placer.load.get(("b", 0))
    assert ld is not None and ld.requests == 1
    f.first_byte()
    assert f.ticket.state is TicketState.DECODE and ld.inflight_prefill == 0
    f.done("200")
    f.done("client_disconnect")
    assert f.ticket.state is TicketState.DONE and placer.load.get(("b", 0)) is None


def test_a_new_prefix_is_predicted_on_its_worker_until_the_ttl() -> None:
    placer, clock = build()
    prompt = list(range(5000, 5000 + 4 * BS))
    d = placer.place(prompt)
    first = d.candidates[d.order[0]].key
    placer.fly(d, d.order[0], "route_account")  # held: the load stays
    again = placer.place(prompt)
    c = again.candidates[again.order[0]]
    assert c.key == first and c.predicted_blocks == 4  # no herding onto an idle worker
    clock.t += placer.predicted.ttl_s + 1
    placer.housekeeping()
    assert len(placer.predicted) == 0
    assert all(x.predicted_blocks == 0 for x in placer.place(prompt).candidates)


def test_a_dropped_worker_leaves_no_load_prediction_or_account() -> None:
    placer, _ = build(("a",))
    d = placer.place(list(range(3 * BS)))
    placer.accounts.add(placer.fly(d, d.order[0], "route_account"))
    assert len(placer.accounts) == 1 and len(placer.predicted) == 3
    placer.drop_worker("a", [("a", 0)])
    assert len(placer.accounts) == 0 and len(placer.predicted) == 0
    assert placer.load.get(("a", 0)) is None
