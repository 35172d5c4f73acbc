"""The live fleet's mixed workers and faults (:mod:`kvrouter.replay.fleet`,
:func:`kvrouter.replay.relay.relayed_specs`, issue 36): which of
kvrouter's ``--worker`` specs have no events, which go through a relay (real ZMQ sockets) and
which keep the engine's replay endpoint; the rows say so, and what the router's loop did (from its
/metrics, served here by a real HTTP server); options that need a fleet of our own
are refused with one."""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvrouter.replay.faults import Faults, add_fault_arguments, row_suffix
from kvrouter.replay.fleet import Fleet, FleetSpec
from kvrouter.replay.live import add_live_arguments, targets_from_args
from kvrouter.replay.relay import relayed_specs
from router.settings.workers import parse_worker_spec


def _fleet(**kw: object) -> Fleet:
    fleet = Fleet(FleetSpec(workers=4, **kw))  # type: ignore[arg-type]
    fleet.endpoints = [  # as four engines' ENGINE_READY lines give them (nothing listens)
        (
            f"http://127.0.0.1:{8000 + i}",
            f"tcp://127.0.0.1:{5500 + i}",
            f"tcp://127.0.0.1:{5600 + i}",
        )
        for i in range(4)
    ]
    return fleet


def test_the_first_without_events_the_last_through_relays() -> None:
    fleet = _fleet(no_events=1, faults=Faults(drop_p=0.2, drop_k=2, seed_k=1))
    try:
        got, relays = relayed_specs(fleet)
        specs = [parse_worker_spec(s) for s in got]
    finally:
        fleet.close()
    assert [s["id"] for s in specs] == [f"engine-{i}" for i in range(4)]
    assert specs[0]["events_endpoint"] == "none" and "replay_endpoint" not in specs[0]
    assert specs[1]["events_endpoint"] == "tcp://127.0.0.1:5501"  # untouched: its own streams
    assert specs[1]["replay_endpoint"] == "tcp://127.0.0.1:5601"
    assert [r.drop_p for r in relays] == [0.2, 0.2] and [r.reseed for r in relays] == [False, True]
    # the router subscribes to the relays; a fresh stream comes from the engine's own replay,
    # except a reseeded one's (which would heal the fault), which has none
    assert [s["events_endpoint"] for s in specs[2:]] == [r.endpoint for r in relays]
    assert specs[2]["replay_endpoint"] == "tcp://127.0.0.1:5602"
    assert "replay_endpoint" not in specs[3]
    assert not any(r._thread.is_alive() for r in relays)  # closed with the fleet


def test_a_silent_restart_goes_through_a_relay_that_swallows_the_clear() -> None:
    fleet = _fleet(faults=Faults(restart_k=1))
    try:
        _, (relay,) = relayed_specs(fleet)
        assert relay.silent_clears and relay.drop_p == 0 and not relay.reseed
    finally:
        fleet.close()


def test_rows_name_the_mixed_fleet_and_the_faults() -> None:
    assert row_suffix(Faults(), 4, 8, router=True) == " [4 of 8 without events]"
    # (smg's routing is approximate for all: run_policy passes no workers without events)
    assert row_suffix(Faults(), 0, 8, router=False) == ""
    lossy = Faults(drop_p=0.2, drop_k=2, loop=False)
    assert row_suffix(lossy, 0, 8, router=True) == " [drop 20% x2; loop off]"
    assert row_suffix(Faults(restart_k=1), 0, 8, router=False) == " [restart x1]"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_live_arguments(p)
    add_fault_arguments(p)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--no-events", type=int, default=0)
    return p


def test_the_options_reach_the_fleet_and_need_one_of_our_own() -> None:
    shape = {"workers": 8, "block_size": 16, "gpu_blocks": 512, "speedup": 1.0}
    argv = ["--no-events", "4", "--fault-drop", "0.2:2", "--loop", "off"]
    t = targets_from_args(_parser().parse_args(argv), **shape)
    assert t.fleet is not None and t.fleet.no_events == 4
    assert t.fleet.faults == Faults(drop_p=0.2, drop_k=2, loop=False)
    for bad in (["--no-events", "2"], ["--fault-restart", "1"]):
        with pytest.raises(ValueError, match="fleet of our own"):
            targets_from_args(_parser().parse_args([*bad, "--router-url", "http://r"]), **shape)
    with pytest.raises(ValueError, match="--no-events must be in"):
        targets_from_args(_parser().parse_args(["--no-events", "9"]), **shape)


TURNED = (
    "# TYPE kvrouter_agreement_disagreements_total counter\n"
    'kvrouter_agreement_disagreements_total{worker="engine-7",reason="index_ahead"} 2.0\n'
    'kvrouter_agreement_disagreements_total{worker="engine-6",reason="worker_ahead"} 0.0\n'
)


class _Metrics(BaseHTTPRequestHandler):
    """Serves its server's ``text`` as a router's /metrics."""

    def do_GET(self) -> None:
        body = self.server.text.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # (quiet)
        pass


def test_the_row_says_which_workers_the_loop_turned() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    server.text = TURNED  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        fleet = Fleet(FleetSpec())
        fleet.router_url = f"http://127.0.0.1:{server.server_address[1]}"
        assert fleet.loop_turns() == "engine-7 x2 index_ahead"  # (a zero counter: not turned)
        server.text = "# TYPE kvrouter_up gauge\nkvrouter_up 1.0\n"
        assert fleet.loop_turns() == "-"
    finally:
        server.shutdown()
        server.server_close()
