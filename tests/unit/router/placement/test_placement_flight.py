"""``router.placement.flight``: one owner for a placed request's ticket and metrics, on a real
:class:`Placer` over a real index and worker table, with the router's Prometheus metrics and a
controlled clock — the placement core alone, as the replay builds it (no socket, no runtime)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from indexer.events import BlockRemoved, BlockStored
from indexer.index import PrefixIndex
from router.edge.usage import cached_tokens_of
from router.fleet.registry import Registry
from router.observe.metrics import RouterMetrics
from router.placement import Flight, PlacementSettings, Placer, RouteAccounts
from router.settings import WorkerConfig, load_settings


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Placed:
    def __init__(self) -> None:
        settings = load_settings(environ={}, overrides={"workers": []})
        self.clock = Clock()
        self.prom = CollectorRegistry()
        fleet = Registry(settings.health, clock=self.clock)
        index = PrefixIndex(settings.block_size)
        for wid in ("a", "b"):
            cfg = WorkerConfig(
                id=wid, url=f"http://{wid}.invalid", events_endpoint="tcp://127.0.0.1:9"
            )
            fleet.add(cfg)  # never dialled
            index.add_worker(wid, 0, model="")
        self.placer = Placer(
            PlacementSettings.of(settings),
            index,
            fleet,
            metrics=RouterMetrics(self.prom),
            clock=self.clock,
        )
        self.load = self.placer.load


@pytest.fixture
def state() -> Placed:
    return Placed()


def metric(st: Placed, text: str) -> bool:
    return text in generate_latest(st.prom).decode()


def flight(st: Placed, kind: str, worker: str = "a", *, by_events: bool = False) -> Flight:
    d = st.placer.place(list(range(64)))
    i = next(i for i, c in enumerate(d.candidates) if c.key[0] == worker)
    return st.placer.fly(d, i, kind, endpoint="completions", by_events=by_events)


def test_a_proxy_flight_counts_once_whatever_ends_it(state) -> None:
    f = flight(state, "proxy")
    assert state.load.inflight("a") == 1 and metric(state, 'inflight_requests{worker="a"} 1.0')
    f.first_byte()
    f.first_byte()
    assert state.load.get(("a", 0)).inflight_prefill == 0
    f.cached = 32
    f.done("200")
    f.done("client_disconnect")  # a late second end changes nothing
    assert state.load.inflight("a") == 0 and metric(state, 'inflight_requests{worker="a"} 0.0')
    assert metric(state, 'proxied_requests_total{endpoint="completions",status="200",worker="a"}')
    assert not metric(state, 'status="client_disconnect"')


def test_route_accounts_end_every_way_once(state) -> None:
    clock = state.clock
    assert isinstance(clock, Clock)
    acc = RouteAccounts(ttl_s=5.0, max_entries=2, clock=clock)
    r1 = acc.add(flight(state, "route_account"))
    r2 = acc.add(flight(state, "route_account"))
    assert len(acc) == 2 and state.load.inflight("a") == 2
    assert acc.release(r1) and not acc.release(r1)
    clock.t += 6
    acc.expire()
    assert len(acc) == 0 and state.load.get(("a", 0)) is None
    assert not acc.release(r2)
    for _ in range(3):  # over max_entries: the oldest ends first
        acc.add(flight(state, "route_account"))
    assert len(acc) == 2 and state.load.inflight("a") == 2
    acc.add(flight(state, "route_account", "b"))
    acc.drop_worker("a")
    assert len(acc) == 1 and state.load.inflight("a") == 0 and state.load.inflight("b") == 1
    for reason, n in (("released", 1), ("expired", 1), ("evicted", 2), ("worker_removed", 1)):
        assert metric(state, f'kvrouter_route_accounts_ended_total{{reason="{reason}"}} {n}.0')
    # an accounted route is not a proxied request
    assert not metric(state, "kvrouter_proxied_requests_total{")


A = ("a", 0)
TOKENS = list(range(64))  # 4 blocks of 16


def store(st: Placed, blocks: range, key: tuple[str, int] = A) -> None:
    """The worker's event for blocks ``blocks`` of TOKENS (engine hashes 1 + block number)."""
    first = blocks[0]
    parent = first if first else None  # (block k's engine hash is k + 1)
    st.placer.index.apply_event(
        key,
        BlockStored([b + 1 for b in blocks], parent, TOKENS[16 * first : 16 * blocks[-1] + 16], 16),
    )
    st.placer.blocks_stored(key)


def prefill(st: Placed) -> float:
    return st.load.get(A).inflight_prefill


def test_an_answers_head_leaves_the_prefill_to_the_events_that_show_it_built(state) -> None:
    # vLLM sends the head before the prefill begins: only the events end it
    f = flight(state, "epp", by_events=True)
    f.head()
    assert prefill(state) == 4 and metric(state, "first_byte_seconds_count")
    store(state, range(0, 2))  # half of it: still building
    assert prefill(state) == 4
    store(state, range(2, 4))
    assert prefill(state) == 0 and state.load.get(A).prefilling == {}
    assert state.placer.awaiting._by_rank[A] == {}
    f.done("200")
    assert state.load.get(A) is None


def test_a_first_byte_or_an_end_stops_the_wait_for_events(state) -> None:
    f, g = flight(state, "epp", by_events=True), flight(state, "route_account", by_events=True)
    # (g's blocks are f's, predicted there: nothing of its own to build, but it waits for them)
    assert not g.ticket.prefill_hashes and len(state.placer.awaiting._by_rank[A]) == 2
    f.first_byte()
    g.done("released")
    # nothing kept for a worker whose events never come
    assert state.placer.awaiting._by_rank[A] == {}
    f.done("200")


def test_an_accounted_route_ends_its_prefill_with_the_events(state) -> None:
    f = flight(state, "route_account", by_events=True)  # its caller sends it: no byte is seen
    store(state, range(0, 4))
    assert prefill(state) == 0 and state.load.inflight("a") == 1
    f.done("released")


def test_a_block_past_a_hole_does_not_end_the_prefill(state) -> None:
    store(state, range(0, 4))
    state.placer.index.apply_event(A, BlockRemoved([2]))  # block 1 gone, 2 and 3 kept
    f = flight(state, "epp", by_events=True)
    f.head()
    assert f.ticket.prefill_hashes and prefill(state) > 0
    state.placer.blocks_stored(A)  # the last block is held, the first to build is not
    assert prefill(state) > 0
    store(state, range(1, 2))
    assert prefill(state) == 0
    f.done("200")


def test_a_request_with_nothing_to_build_ends_its_prefill_at_the_head(state) -> None:
    store(state, range(0, 4))
    f = flight(state, "epp", by_events=True)
    assert not f.ticket.prefill_hashes and not state.placer.awaiting._by_rank.get(A)
    f.head()
    assert prefill(state) == 0
    f.done("200")


def test_only_flights_made_by_events_wait_and_a_rank_holds_a_bounded_number(
    state, monkeypatch
) -> None:
    f = flight(state, "proxy")  # its first byte ends the prefill: nothing to wait for
    assert not state.placer.awaiting._by_rank.get(A)
    f.done("200")
    monkeypatch.setattr("router.placement.awaiting._MAX_AWAITING", 2)
    held = [flight(state, "route_account", by_events=True) for _ in range(3)]
    assert len(state.placer.awaiting._by_rank[A]) == 2 and held[2].awaiting is None
    held[2].head()  # past the bound: the head ends it, as before the events did
    assert held[2].ticket.state.name == "DECODE" and held[0].ticket.state.name == "PREFILL"
    for g in held:
        g.done("released")


def test_cached_tokens_of_reads_usage_or_nothing() -> None:
    body = b'{"usage": {"prompt_tokens_details": {"cached_tokens": 48}}}'
    assert cached_tokens_of(body) == 48
    assert cached_tokens_of(b'{"usage": null}') is None
    assert cached_tokens_of(b"not json") is None
