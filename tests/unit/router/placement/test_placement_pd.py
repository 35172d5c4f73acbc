"""The joint prefill/decode decision (``router.placement.pd``) on a real index and worker table:
decode worker first, then local against remote in token counts, each mode, and the two legs'
accounting (the prefill worker builds, the decode worker only holds)."""

from __future__ import annotations

from typing import Any

import pytest

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from router.errors import NoHealthyWorker
from router.fleet.registry import Registry
from router.placement import (
    AGGREGATED,
    LOCAL,
    NO_METRICS,
    REMOTE,
    PlacementSettings,
    Placer,
    TicketState,
    placed_event,
)
from router.settings import WorkerConfig, load_settings

BS = 16
PROMPT = list(range(1000, 1000 + 40 * BS))  # 640 tokens, 40 blocks


class Metrics(type(NO_METRICS)):  # type: ignore[misc]
    """Hears the decisions (the rest goes nowhere)."""

    def __init__(self) -> None:
        self.decisions: list[tuple[str, str]] = []

    def pd_decided(self, decision: str, reason: str) -> None:
        self.decisions.append((decision, reason))


def build(roles: dict[str, str], **pd: Any) -> tuple[Placer, Metrics]:
    settings = load_settings(environ={}, overrides={"block_size": BS, "pd": pd})
    fleet = Registry(settings.health, clock=lambda: 0.0)
    index = PrefixIndex(BS)
    for wid, role in roles.items():
        url = f"http://{wid}.invalid"
        fleet.add(WorkerConfig(id=wid, url=url, events_endpoint="tcp://x:1", role=role))
        index.add_worker(wid, 0)
    m = Metrics()
    return Placer(PlacementSettings.of(settings), index, fleet, metrics=m, clock=lambda: 0.0), m


def store(placer: Placer, worker: str, blocks: int, tier: str = "GPU") -> None:
    ev = BlockStored(list(range(1, blocks + 1)), None, PROMPT[: blocks * BS], BS, tier=tier)
    placer.index.apply_event((worker, 0), ev)


def test_a_fleet_without_prefill_workers_is_aggregated_as_before() -> None:
    placer, m = build({"a": "both", "b": "both"})
    store(placer, "b", 10)
    d = placer.place(PROMPT)
    p = placer.pick(d)
    assert p.mode == AGGREGATED and not p.disaggregated and p.prefill is None
    assert p.decode.index == d.order[0] and p.decode.worker.id == "b"
    assert m.decisions == []  # nothing to decide


def test_the_decode_worker_is_never_a_prefill_only_one() -> None:
    placer, _ = build({"p": "prefill", "d": "decode"})
    store(placer, "p", 40)  # p holds it all: the best-ranked, but it cannot decode
    p = placer.pick(placer.place(PROMPT))
    assert p.decode.worker.id == "d" and [c.worker.id for c in p.decodes] == ["d"]
    assert p.mode == REMOTE and p.prefill is not None and p.prefill.worker.id == "p"


def test_no_decode_worker_is_one_typed_error() -> None:
    placer, _ = build({"p": "prefill"})
    with pytest.raises(NoHealthyWorker):
        placer.pick(placer.place(PROMPT))


@pytest.mark.parametrize(
    ("held", "mode"),
    [(0, REMOTE), (30, LOCAL), (39, LOCAL), (20, REMOTE)],
)
def test_threshold_counts_what_the_decode_worker_lacks(held: int, mode: str) -> None:
    # 640 tokens; remote when D lacks >= 256 tokens and >= 30 % of them
    placer, m = build({"p": "prefill", "d": "decode"}, mode="threshold")
    if held:
        store(placer, "d", held)
    p = placer.pick(placer.place(PROMPT))
    assert p.uncached_decode == 640 - min(held, 39) * BS
    assert p.mode == mode
    assert m.decisions == [(mode, "over_threshold" if mode == REMOTE else "under_threshold")]


def test_host_tiers_count_as_tokens_held_not_as_weighted_scores() -> None:
    # llm-d's decider read the tier-weighted score as a block count: 30 blocks on CPU weighted
    # 0.8 would look like 24 held and 256 lacking (remote). They are 30 held: 160 lacking.
    placer, _ = build({"p": "prefill", "d": "decode"}, mode="threshold")
    store(placer, "d", 30, tier="CPU_PINNED")
    p = placer.pick(placer.place(PROMPT))
    assert p.uncached_decode == 160 and p.mode == LOCAL


def test_modes_always_never_and_one_leg_requests() -> None:
    placer, _ = build({"p": "prefill", "d": "decode"}, mode="always")
    store(placer, "d", 39)
    assert placer.pick(placer.place(PROMPT)).mode == REMOTE
    p = placer.pick(placer.place(PROMPT), allow_remote=False)
    assert (p.mode, p.reason) == (LOCAL, "decode_only_request")
    never, _ = build({"p": "prefill", "d": "decode"}, mode="never")
    p = never.pick(never.place(PROMPT))
    assert (p.mode, p.reason, p.prefills[0].worker.id) == (LOCAL, "mode_never", "p")


def test_no_healthy_prefill_worker_is_local() -> None:
    placer, _ = build({"p": "prefill", "d": "decode"})
    placer.fleet.workers["p"].healthy = False
    p = placer.pick(placer.place(PROMPT))
    assert (p.mode, p.reason, p.prefills) == (LOCAL, "no_prefill_worker", [])


def test_cost_mode_weighs_queues_interference_and_the_transfer() -> None:
    placer, _ = build({"p": "prefill", "d": "decode"}, mode="cost")
    p = placer.pick(placer.place(PROMPT))  # D lacks 640, P lacks 640: the hop is not worth it
    assert (p.mode, p.reason) == (LOCAL, "cost_local")
    assert p.remote_cost == pytest.approx(640 + 0.1 * 640 + 64) and p.local_cost == 640
    # D busy: a local prefill stalls its steps, 1 + 0.2 per request there (no max_tokens); remote
    # costs 640 + 64 + 64 = 768: one request decoding keeps it local (x 1.2 = 768 ties, and a
    # tie stays local), two send it remote
    flights = []
    for k in range(3):
        other = list(range(9000 + 100 * k, 9000 + 100 * k + 4 * BS))
        busy = placer.place(other)
        flights.append(placer.fly(busy, placer.pick(busy).decode.index, "proxy"))
        flights[-1].first_byte()
        p = placer.pick(placer.place(PROMPT))
        assert p.local_cost == pytest.approx((1 + 0.2 * (k + 1)) * 640)
        assert p.mode == (LOCAL if k < 1 else REMOTE)
    assert p.reason == "cost_remote"
    # a request that finished decodes no more: D is as cheap as with one decoding again
    flights[0].done("200")
    flights[1].done("200")
    assert placer.pick(placer.place(PROMPT)).local_cost == pytest.approx(1.2 * 640)
    # P holding the prefix makes remote cheaper still
    store(placer, "p", 39)
    q = placer.pick(placer.place(PROMPT))
    assert q.uncached_prefill == 640 - 39 * BS and q.remote_cost < p.remote_cost


@pytest.mark.parametrize(
    ("max_tokens", "weight", "mode"),
    [(None, 1.0, LOCAL), (1, 0.0, LOCAL), (401, 0.5, LOCAL), (11, 4.0, REMOTE)],
)
def test_a_short_answer_on_the_decode_worker_makes_a_prefill_there_dearer(
    max_tokens: int | None, weight: float, mode: str
) -> None:
    placer, _ = build({"p": "prefill", "d": "decode"}, mode="cost")
    busy = placer.place(list(range(9000, 9000 + 4 * BS)), max_tokens=max_tokens)
    placer.fly(busy, placer.pick(busy).decode.index, "proxy").first_byte()  # queues nothing
    p = placer.pick(placer.place(PROMPT))
    # 200 reference tokens / (max_tokens - 1), at most 4; unknown: 1; one token: no stream
    assert p.decode.cand.stall == weight
    # remote costs 640 + 64 + 64 = 768, local 640 x (1 + 0.2 x weight); a tie stays local
    assert p.local_cost == pytest.approx(640 * (1 + 0.2 * weight))
    assert p.mode == mode


def test_a_prefill_leg_weighs_nothing_where_it_runs() -> None:
    # a 'both' worker prefilling for another decodes nothing of that request: no stream stalls
    placer, _ = build({"b": "both", "d": "decode"}, mode="always")
    d = placer.place(PROMPT, max_tokens=11)
    at = {st.id: i for i, st in enumerate(d.states)}
    placer.fly(d, at["d"], "proxy", leg="decode")
    placer.fly(d, at["b"], "proxy", leg="prefill")
    assert {k[0]: ld.stall for k, ld in placer.load.items()} == {"d": 4.0, "b": 0.0}


def test_the_prefill_worker_is_the_one_with_least_prefill_work() -> None:
    placer, _ = build({"p1": "prefill", "p2": "prefill", "d": "decode"}, mode="always")
    store(placer, "p2", 20)
    p = placer.pick(placer.place(PROMPT))
    assert [c.worker.id for c in p.prefills] == ["p2", "p1"]
    # a 'both' worker may prefill for another decode worker, never for itself
    mixed, _ = build({"b": "both", "p": "prefill"}, mode="always")
    p = mixed.pick(mixed.place(PROMPT))
    assert p.decode.worker.id == "b" and [c.worker.id for c in p.prefills] == ["p"]


def test_a_remote_pick_builds_on_the_prefill_worker_and_holds_on_both() -> None:
    placer, _ = build({"p": "prefill", "d": "decode"}, mode="always")
    d = placer.place(PROMPT)
    p = placer.pick(d)
    assert p.prefill is not None
    pf = placer.fly(d, p.prefill.index, "proxy", leg="prefill")
    df = placer.fly(d, p.decode.index, "proxy", leg="decode")
    lp, ld = placer.load.get(("p", 0)), placer.load.get(("d", 0))
    assert lp is not None and lp.inflight_prefill == 40  # P builds the prompt ...
    assert ld is not None and ld.inflight_prefill == 0 and ld.active_blocks == 41  # D holds it
    assert df.ticket.state is TicketState.PREFILL
    slots = {placer.index.slot(("p", 0)), placer.index.slot(("d", 0))}
    # ... and after the request both caches hold it (vLLM's decode worker stores what it pulled)
    again = placer.place(PROMPT)
    assert {c.key[0]: c.predicted_blocks for c in again.candidates} == {"p": 40, "d": 40}
    assert len(slots) == 2
    pf.first_byte()
    pf.done("200")
    df.first_byte()
    df.done("200")
    assert placer.load.get(("p", 0)) is None and placer.load.get(("d", 0)) is None


def test_admission_counts_until_released_once() -> None:
    placer, _ = build({"a": "both"})
    a = placer.admit()
    assert placer.inflight == 1
    a.release()
    a.release()
    assert placer.inflight == 0


class Heard:
    """A placement listener (what replica sync is): records each ticket's life."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float]] = []

    def committed(self, t: Any) -> None:
        self.events.append(("committed", t.key[0], t.prefill))

    def first_token(self, t: Any) -> None:
        self.events.append(("first_token", t.key[0], t.prefill))

    def ended(self, t: Any) -> None:
        self.events.append(("ended", t.key[0], t.prefill))


def test_replica_sync_hears_both_legs_as_any_other_placement() -> None:
    placer, _ = build({"p": "prefill", "d": "decode"}, mode="always")
    heard = Heard()
    placer.listener = heard
    d = placer.place(PROMPT)
    p = placer.pick(d)
    assert p.prefill is not None
    pf = placer.fly(d, p.prefill.index, "proxy", leg="prefill")
    df = placer.fly(d, p.decode.index, "proxy", leg="decode")
    # what the peers learn: P builds 40 blocks, D holds the 40 it will pull and builds none
    on_p, on_d = placed_event(pf.ticket, 8192), placed_event(df.ticket, 8192)
    assert (on_p.worker, on_p.prefill, on_p.matched) == ("p", 40.0, 0)
    assert (on_d.worker, on_d.prefill, on_d.matched) == ("d", 0.0, 40)
    pf.first_byte()
    pf.done("200")
    df.first_byte()
    df.done("200")
    assert heard.events == [
        ("committed", "p", 40.0),
        ("committed", "d", 0.0),
        ("first_token", "p", 40.0),
        ("ended", "p", 40.0),
        ("first_token", "d", 0.0),
        ("ended", "d", 0.0),
    ]


def test_a_prefill_engine_with_a_new_id_is_a_new_epoch() -> None:
    placer, _ = build({"p": "prefill", "d": "decode"}, mode="always")
    d = placer.place(PROMPT)
    placer.fly(d, placer.pick(d).prefills[0].index, "proxy", leg="prefill").done("200")
    keys = [("p", 0)]
    assert not placer.engine_seen("p", "engine-1", keys)  # the first id: no restart
    assert placer.place(PROMPT).candidates[0].predicted_blocks == 40
    assert not placer.engine_seen("p", "engine-1", keys)
    assert placer.engine_seen("p", "engine-2", keys)  # restarted: its predictions go
    assert {c.key[0]: c.predicted_blocks for c in placer.place(PROMPT).candidates}["p"] == 0
