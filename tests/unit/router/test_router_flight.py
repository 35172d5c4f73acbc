"""``router.flight``: one owner for a placed request's ticket and metrics, on a real
``RouterState`` (never started: no socket is opened) with a controlled clock."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from prometheus_client import generate_latest

from router.flight import Flight, RouteAccounts, cached_tokens_of
from router.service import RouterState
from router.settings import WorkerConfig, load_settings


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def state() -> AsyncIterator[RouterState]:
    st = RouterState(load_settings(environ={}, overrides={"workers": []}), clock=Clock())
    for wid in ("a", "b"):
        cfg = WorkerConfig(id=wid, url=f"http://{wid}.invalid", events_endpoint="tcp://127.0.0.1:9")
        st.registry.add(cfg)  # never dialled
        st.index.add_worker(wid, 0, model="")
    yield st
    await st.subscriber.aclose()  # never started: this only releases the ZMQ context
    await st.upstream.aclose()


def metric(st: RouterState, text: str) -> bool:
    return text in generate_latest(st.prom).decode()


def flight(st: RouterState, kind: str, worker: str = "a") -> Flight:
    d = st.place(list(range(64)))
    i = next(i for i, c in enumerate(d.candidates) if c.key[0] == worker)
    return Flight(st, d, i, kind, endpoint="completions")


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
