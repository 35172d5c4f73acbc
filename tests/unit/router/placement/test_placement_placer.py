"""``router.placement.Placer`` alone — a real index fed real events, a real worker table, no
metrics, a controlled clock: what the replay builds, and what every front door calls."""

from __future__ import annotations

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from router.fleet.registry import Registry
from router.placement import NO_METRICS, PlacementSettings, Placer, TicketState
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
    return Placer(
        PlacementSettings.of(settings), index, fleet, metrics=NO_METRICS, clock=clock
    ), clock


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


def test_capacity_reaches_the_candidates_from_the_index() -> None:
    placer, _ = build(("a", "b"))
    placer.index.set_rank_capacity(("a", 0), {"GPU": 64, "CPU_PINNED": 1000})
    d = placer.place(list(range(4 * BS)))
    cap = {c.key[0]: c.capacity for c in d.candidates}
    assert cap == {"a": 64, "b": 0}  # GPU blocks only; b reported none


def test_a_request_goes_where_it_fits_beside_the_running_ones() -> None:
    placer, _ = build(("a", "b"))
    placer.index.set_rank_capacity(("a", 0), {"GPU": 40})
    placer.index.set_rank_capacity(("b", 0), {"GPU": 64})
    # a runs two requests of 12 blocks (26 blocks held with their decode blocks), b one of 30
    # (31): a holds fewer, but a 16-block request fits only beside b's
    for j, (w, n) in enumerate((("a", 12), ("a", 12), ("b", 30))):
        prompt = list(range(1000 * (j + 1), 1000 * (j + 1) + n * BS))  # no block in common
        d = placer.place(prompt)
        i = next(k for k, c in enumerate(d.candidates) if c.key == (w, 0))
        placer.fly(d, i, "proxy").first_byte()  # prefilled: decoding, holding its blocks
    d = placer.place(list(range(40000, 40000 + 16 * BS)))
    a, b = (next(c for c in d.candidates if c.key == (w, 0)) for w in ("a", "b"))
    assert (a.active_blocks, b.active_blocks) == (26, 31)
    assert d.candidates[d.order[0]].key == ("b", 0)
    # a pays for the 2 blocks that do not fit beside its 26 in 40
    assert a.cost - b.cost == placer.weights.overlap_weight * 2 + (26 - 31)


def test_replicas_in_different_lanes_place_a_same_instant_burst_apart() -> None:
    """Two replicas with one view (a sync has landed) each take a new request in the same
    instant: without lanes both take the same worker; in lanes 0 and 1 they take two."""
    placers = [build()[0], build()[0]]
    prompt = list(range(1000, 1000 + 8 * BS))

    def firsts() -> list[tuple[str, int]]:
        ds = [p.place(prompt) for p in placers]
        return [d.candidates[d.order[0]].key for d in ds]

    alike = firsts()
    assert alike[0] == alike[1]
    for lane, p in enumerate(placers):
        p.lane = (lane, 2)
    apart = firsts()
    assert apart[0] == alike[0] and apart[1] != apart[0]
