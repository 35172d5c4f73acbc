"""Remote state's memory per hash (replica sync, issue 37): what ``router.placement.remote``'s
``HASH_BYTES`` (256 B) budgets by, measured with tracemalloc.

Run (a few seconds):

    python benchmarks/bench_remote_memory.py

One peer message of 40 tickets x 8,192 distinct hashes is decoded and applied to a fresh placer's
``RemoteTickets``; what stays allocated once the message is gone is divided by the hashes: the
ticket's hash lists, the ledger's active (and prefilling) refcounts, and, for hashes not matched,
the prediction's entries. Twice: hashes kept as the decoded list (what remote.py does), and as
``array('q')`` (8 B a hash: the compact form the issue suggested). Measured here (2026-11):

    list     matched=all:  75.8 B/hash    list     matched=0: 243.8 B/hash
    array(q) matched=all:  75.6 B/hash    array(q) matched=0: 314.6 B/hash

The array saves nothing: the ledger's and the prediction's dicts need an int object per hash
whatever holds the list (the decoded list's ints are those same objects), and iterating an array
makes new ones. So remote.py keeps lists, and budgets 256 B a hash, the worst case above.
"""

from __future__ import annotations

import array
import gc
import random
import tracemalloc

from indexer.index import PrefixIndex
from router.fleet.registry import Registry
from router.placement import Placed, PlacementSettings, Placer
from router.runtime.replicas.wire import VERSION, SyncMessage, decode, encode
from router.settings import WorkerConfig, load_settings

TICKETS, HASHES = 40, 8192


def placer() -> Placer:
    s = load_settings(
        environ={},
        overrides={"workers": [], "block_size": 16, "replicas": {"trusted_network": True}},
    )
    fleet, index = Registry(s.health), PrefixIndex(16)
    fleet.add(WorkerConfig(id="a", url="http://a.invalid", events_endpoint="tcp://x:1"))
    index.add_worker("a", 0)
    return Placer(PlacementSettings.of(s), index, fleet)


def per_hash(compact: bool, matched_all: bool) -> float:
    p, rng = placer(), random.Random(1)
    matched = HASHES if matched_all else 0
    evs = [
        Placed(t, "a", 0, [rng.getrandbits(63) for _ in range(HASHES)], 10.0, matched)
        for t in range(TICKETS)
    ]
    frame = encode(SyncMessage(VERSION, "peer", 0, 16, list(evs)))
    del evs
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    events = decode(frame).events
    if compact:
        events = [
            Placed(e.ticket, e.worker, e.rank, array.array("q", e.hashes), e.prefill, e.matched)  # type: ignore[union-attr,arg-type]
            for e in events
        ]
    p.remote.apply("peer", events)
    del events
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / (TICKETS * HASHES)


def main() -> None:
    for compact in (False, True):
        for matched_all in (True, False):
            kind = "array(q)" if compact else "list    "
            m = "all" if matched_all else "0"
            print(f"{kind} matched={m}: {per_hash(compact, matched_all):.1f} B/hash")


if __name__ == "__main__":
    main()
