"""``router.placement.flight``: one owner for a placed request's ticket and metrics, on a real
:class:`Placer` over a real index and worker table, with the router's Prometheus metrics and a
controlled clock — the placement core alone, as the replay builds it (no socket, no runtime)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from indexer.index import PrefixIndex
from router.fleet.registry import Registry
from router.observe.metrics import RouterMetrics
from router.placement import Flight, Placer, RouteAccounts, cached_tokens_of
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
            settings, index, fleet, metrics=RouterMetrics(self.prom), clock=self.clock
        )
        self.load = self.placer.load


@pytest.fixture
def state() -> Placed:
    return Placed()


def metric(st: Placed, text: str) -> bool:
    return text in generate_latest(st.prom).decode()


def flight(st: Placed, kind: str, worker: str = "a") -> Flight:
    d = st.placer.place(list(range(64)))
    i = next(i for i, c in enumerate(d.candidates) if c.key[0] == worker)
    return st.placer.fly(d, i, kind, endpoint="completions")


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


def test_cached_tokens_of_reads_usage_or_nothing() -> None:
    body = b'{"usage": {"prompt_tokens_details": {"cached_tokens": 48}}}'
    assert cached_tokens_of(body) == 48
    assert cached_tokens_of(b'{"usage": null}') is None
    assert cached_tokens_of(b"not json") is None
