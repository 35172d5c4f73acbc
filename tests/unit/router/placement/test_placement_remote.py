"""Remote tickets (``router.placement.remote``): two real placers over the same workers, each
with its own index, and the events one's listener hears applied to the other's — replica sync
without sockets, on a controlled clock, as ``kvrouter replay`` would run it."""

from __future__ import annotations

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from router.fleet.registry import Registry
from router.placement import (
    Ended,
    EventLog,
    FirstToken,
    Placed,
    PlacementSettings,
    Placer,
    TicketState,
    placed_event,
)
from router.settings import WorkerConfig, load_settings

BS = 16
WORKERS = ("a", "b", "c")


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def build(clock: Clock, **replicas: object) -> Placer:
    settings = load_settings(
        environ={}, overrides={"workers": [], "block_size": BS, "replicas": replicas}
    )
    fleet = Registry(settings.health, clock=clock)
    index = PrefixIndex(BS)
    for wid in WORKERS:
        fleet.add(WorkerConfig(id=wid, url=f"http://{wid}.invalid", events_endpoint="tcp://x:1"))
        index.add_worker(wid, 0)
    return Placer(PlacementSettings.of(settings), index, fleet, clock=clock)


def pair(**replicas: object) -> tuple[Placer, Placer, EventLog, Clock]:
    clock = Clock()
    a, b = build(clock, **replicas), build(clock, **replicas)
    heard = EventLog()
    a.listener = heard
    return a, b, heard, clock


def toks(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BS)]


def store(p: Placer, worker: str, tokens: list[int]) -> None:
    n = len(tokens) // BS
    p.index.apply_event((worker, 0), BlockStored(list(range(1, n + 1)), None, tokens, BS))


def best(p: Placer, tokens: list[int]) -> tuple[str, int]:
    d = p.place(tokens)
    c = d.candidates[d.order[0]]
    return c.key[0], c.predicted_blocks


def test_a_peer_follows_the_prefix_its_peer_is_computing() -> None:
    a, b, heard, _ = pair()
    prompt = toks(1, 12)
    d = a.place(prompt)
    chosen = d.candidates[d.order[0]].key[0]
    flight = a.fly(d, d.order[0], "proxy")
    (placed,) = heard.events
    assert isinstance(placed, Placed) and placed.worker == chosen and placed.matched == 0
    # b has not heard: nothing predicted; the follow-up below may go anywhere
    assert all(c.predicted_blocks == 0 for c in b.place(prompt + toks(2, 2)).candidates)
    b.remote.apply("peer-a", heard.take())
    assert len(b.remote) == 1 and b.load.get((chosen, 0)) is not None
    # a follow-up sharing the 12-block prefix goes where a sent the first: predicted there
    assert best(b, prompt + toks(2, 2)) == (chosen, 12)
    flight.first_byte()
    b.remote.apply("peer-a", heard.take())
    ld = b.load.get((chosen, 0))
    assert ld is not None and ld.inflight_prefill == 0 and ld.requests == 1
    flight.done("200")
    b.remote.apply("peer-a", heard.take())
    assert len(b.remote) == 0 and b.load.get((chosen, 0)) is None
    assert b.remote.ended["ended"] == 1


def test_a_peers_burst_steers_load_away() -> None:
    """Load placed by a sees b choose as a would: b's ledger holds a's tickets."""
    a, b, heard, _ = pair()
    shared = toks(3, 6)
    for p in (a, b):
        store(p, "a", shared)  # both indexes: worker a holds the prefix
    assert best(b, shared + toks(4, 1))[0] == "a"
    flights = []
    for i in range(6):  # a burst through replica a, all on worker a (its cache), held
        d = a.place(shared + toks(10 + i, 8))
        i_a = next(i for i, c in enumerate(d.candidates) if c.key == ("a", 0))
        flights.append(a.fly(d, i_a, "proxy"))
    b.remote.apply("peer-a", heard.take())
    la, lb = a.load.get(("a", 0)), b.load.get(("a", 0))
    assert la is not None and lb is not None
    assert (lb.requests, lb.inflight_prefill, lb.active_blocks) == (
        la.requests,
        la.inflight_prefill,
        la.active_blocks,
    )
    q = shared + toks(5, 1)
    assert best(b, q)[0] == best(a, q)[0] != "a"  # b steers away exactly as a does
    for f in flights:
        f.done("200")
    b.remote.apply("peer-a", heard.take())
    assert best(b, q)[0] == "a" and b.load.get(("a", 0)) is None


def test_a_lost_end_expires_by_ttl_and_the_bound_evicts_the_oldest() -> None:
    a, b, heard, clock = pair(ticket_ttl_s=30.0, max_remote_tickets=2)
    flights = [a.fly(d, d.order[0], "proxy") for d in (a.place(toks(20 + i, 3)) for i in range(3))]
    events = heard.take()
    b.remote.apply("peer-a", events[:1])
    clock.t += 10
    b.remote.apply("peer-a", events[1:])  # a third live ticket: the oldest goes
    assert len(b.remote) == 2 and b.remote.ended["evicted"] == 1
    flights[0].done("200")
    b.remote.apply("peer-a", heard.take())  # the end of an evicted ticket: nothing to do
    assert len(b.remote) == 2 and b.remote.ended["ended"] == 0
    # the other two ends are lost, which the glue sees as a gap in a's sequence numbers:
    # their tickets expire 30 s after b started them
    for f in flights[1:]:
        f.done("200")
    heard.take()
    b.remote.gap("peer-a")
    clock.t += 29.9
    b.housekeeping()
    assert len(b.remote) == 2
    clock.t += 0.2
    b.housekeeping()
    assert len(b.remote) == 0 and b.remote.ended["expired"] == 2
    assert all(ld.requests == 0 for _, ld in b.load.items())


def test_without_a_gap_a_long_request_counts_until_its_end() -> None:
    """No message from its origin was lost, so its end is still to come: a ticket outlives any
    number of TTLs (a long generation); one placed after a gap is not exposed by it."""
    a, b, heard, clock = pair(ticket_ttl_s=30.0)
    d = a.place(toks(30, 3))
    long = a.fly(d, d.order[0], "proxy")
    b.remote.apply("peer-a", heard.take())
    for _ in range(10):  # 300 s: ten TTLs, each looked at and renewed
        clock.t += 30.1
        b.housekeeping()
    assert len(b.remote) == 1 and b.remote.ended["expired"] == 0
    key = long.ticket.key
    ld = b.load.get(key)
    assert ld is not None and ld.requests == 1
    b.remote.gap("peer-a")  # lost messages: the long one's end may be among them ...
    d = a.place(toks(31, 3))
    later = a.fly(d, d.order[0], "proxy")
    b.remote.apply("peer-a", heard.take())  # ... but not the end of one placed after them
    assert len(b.remote) == 2
    clock.t += 30.1
    b.housekeeping()
    assert len(b.remote) == 1 and b.remote.ended["expired"] == 1
    for _ in range(3):
        clock.t += 30.1
        b.housekeeping()
    assert len(b.remote) == 1  # the later one lives on until its end arrives
    long.done("200")
    later.done("200")
    b.remote.apply("peer-a", heard.take())
    assert len(b.remote) == 0 and b.remote.ended["ended"] == 1
    assert b.load.get(later.ticket.key) is None


def test_events_past_the_bounds_or_for_unknown_ranks_are_dropped_and_counted() -> None:
    _, b, _, _ = pair(max_hashes=4)
    b.remote.apply(
        "p",
        [
            Placed(1, "zzz", 0, [1, 2], 2.0, 0),  # a worker b does not know
            Placed(2, "a", 7, [1, 2], 2.0, 0),  # a rank it does not know
            Placed(3, "a", 0, [1, 2, 3, 4, 5], 5.0, 0),  # over max_hashes
            Placed(4, "a", 0, [1, 2], 2.0, 3),  # matched past its hashes
            Placed(5, "a", 0, [1, 2], 2.0, 0),
            Placed(5, "a", 0, [1, 2], 2.0, 0),  # the same ticket again
            FirstToken(99),  # never placed: nothing
            Ended(98),
        ],
    )
    assert b.remote.dropped == {
        "unknown_worker": 2,
        "too_many_hashes": 2,
        "duplicate": 1,
        "too_large": 0,
    }
    assert len(b.remote) == 1
    # another origin's ticket 5 is another ticket; a silent origin's tickets all end
    b.remote.apply("q", [Placed(5, "b", 0, [7], 1.0, 0)])
    assert len(b.remote) == 2 and b.remote.origins() == {"p", "q"}
    assert b.remote.drop_origin("p") == 1 and b.remote.ended["peer_lost"] == 1
    b.drop_worker("b", [("b", 0)])
    assert len(b.remote) == 0 and b.remote.ended["worker_removed"] == 1


def test_a_remote_ticket_is_a_ledger_ticket_like_a_local_one() -> None:
    a, b, heard, _ = pair()
    store(a, "b", toks(6, 4))
    store(b, "b", toks(6, 4))
    d = a.place(toks(6, 10))
    f = a.fly(d, d.order[0], "route_account")
    b.remote.apply("peer-a", heard.take())
    (_, (_, _, t)), *_ = b.remote._tickets.items()
    assert t.state is TicketState.PREFILL
    assert (t.key, list(t.hashes), t.prefill) == (
        f.ticket.key,
        list(f.ticket.hashes),
        f.ticket.prefill,
    )
    assert list(t.prefill_hashes) == list(f.ticket.prefill_hashes)


def test_a_long_prompt_is_sent_as_its_prefix() -> None:
    a, _, heard, _ = pair(max_hashes=4)
    d = a.place(toks(7, 10))
    f = a.fly(d, d.order[0], "proxy")
    ev = placed_event(f.ticket, 4)
    assert ev.hashes == list(f.ticket.hashes[:4]) and ev.matched == 0 and ev.prefill == 10
    assert heard.take()[0].hashes == list(f.ticket.hashes)  # (the log's own bound: 2^20)
