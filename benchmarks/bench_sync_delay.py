"""Replica sync's delay, live: how long after replica A answers a placement does replica B
count it (issue 23: replicas place as one while the fleet's request rate times this delay stays
well below one; ``docs/replay.md`` "Router replicas" measures the rest in virtual time).

Run (about 20 s; nothing else should be running):

    python benchmarks/bench_sync_delay.py                 # tcp, CURVE (a peer key), then none
    python benchmarks/bench_sync_delay.py --rounds 500 --transport ipc --auth key

What runs, all real processes on 127.0.0.1, every HTTP port bound 0 and read back:

- one upstream, ``bench_epp.py --serve-upstream`` (only its health answers matter here);
- replicas A and B, two ``kvrouter serve`` (``python -m router``) with that one worker, synced:
  ``replicas.sync_bind`` on ``--transport tcp`` (loopback; each sync port a free one the kernel
  handed out and this process released just before, the one port here that is not bound 0 by its
  owner, as a pod's fixed sync port would be) or ``ipc`` (a socket file in a private directory),
  each the other's ``replicas.peers``; both ready and each hearing the other before measuring.
  ``--auth key`` gives both the same ``replicas.peer_key_file`` (sync runs CURVE: authenticated
  and encrypted, as deployed), ``none`` sets ``trusted_network`` (ZMQ's NULL mechanism);
  ``both`` (the default) measures one pair of each, so CURVE's added delay reads off the two
  tables.

Per round: a new 64-block prompt is placed on A with ``POST /route {"account": true}`` (a ticket
that counts until released), and from the moment A's answer is read, B's ``POST /route`` for the
same prompt is asked back to back until B's candidate shows A's ticket (its in-flight prefill
above 0); then the ticket is released on A and B is asked again until it shows the end. Each
delay is from A's answer to the B answer that first showed it, so it is an upper bound: it
includes the B ``/route`` calls themselves (their p50 is printed, to read the delay against),
and at most one of them was asked before the event arrived. "first ask" is the share of rounds
whose very first B call, right after A's answer, already showed it.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_epp import stats  # noqa: E402
from bench_route import Client  # noqa: E402
from children import Children  # noqa: E402

BS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def inflight(c: Client, body: bytes) -> tuple[float, float]:
    status, answer, elapsed = c.call("POST", "/route", body)
    assert status == 200, answer
    (cand,) = json.loads(answer)["candidates"]
    return float(cand["inflight_prefill_blocks"]), elapsed


def until(c: Client, body: bytes, seen: Any) -> tuple[float, bool, list[float]]:
    """Ask B until ``seen(inflight)``: (seconds from now, first ask saw it, each call's time)."""
    t0 = time.perf_counter()
    calls = []
    first = True
    while True:
        v, elapsed = inflight(c, body)
        calls.append(elapsed)
        if seen(v):
            return time.perf_counter() - t0, first, calls
        first = False
        if time.perf_counter() - t0 > 10:
            raise SystemExit("replica B never showed replica A's ticket")


def run(args: argparse.Namespace, auth: str) -> dict[str, Any]:
    import yaml

    from kvrouter.up import ROUTER_READY, answers_ok, router_argv, wait_until

    with Children("bench-sync-delay") as kids:
        upstream, events = kids.upstream()
        if args.transport == "tcp":
            eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        else:
            eps = [f"ipc://{kids.tmp}/{name}.sock" for name in ("a", "b")]
        trust: dict[str, Any] = {"trusted_network": True}
        if auth == "key":
            key = kids.tmp / "peer-key"
            key.write_text(secrets.token_hex(32))
            trust = {"peer_key_file": str(key)}
        urls = []
        for i, name in enumerate(("a", "b")):
            cfg = kids.tmp / f"{name}.yaml"
            replicas = {"sync_bind": eps[i], "peers": [eps[1 - i]], **trust}
            cfg.write_text(yaml.safe_dump({"replicas": replicas}))
            argv = [*router_argv([f"id=up,url={upstream},events={events}"], block_size=BS)]
            argv += ["--config", str(cfg), "--log-level", "warning"]
            r = kids.spawn(f"router-{name}", argv)
            urls.append(r.wait_line(ROUTER_READY, 60, kids.stop).group(1))
        for url in urls:
            wait_until(lambda url=url: answers_ok(url + "/ready"), 60, "a replica's /ready")
        a, b = Client(urls[0]), Client(urls[1])

        def peers(c: Client) -> float:
            _, text, _ = c.call("GET", "/metrics")
            for family in text_string_to_metric_families(text.decode()):
                if family.name == "kvrouter_replica_peers":
                    return sum(sample.value for sample in family.samples)
            return 0.0

        wait_until(lambda: all(peers(c) >= 1 for c in (a, b)), 30, "each replica hearing the other")
        placed, ended, calls = [], [], []
        first_placed = first_ended = 0
        for i in range(args.warmup + args.rounds):
            prompt = [i * 64 * BS + j for j in range(64 * BS)]  # new every round: nothing cached
            status, answer, _ = a.call(
                "POST", "/route", json.dumps({"token_ids": prompt, "account": True}).encode()
            )
            assert status == 200, answer
            route_id = json.loads(answer)["route_id"]
            body = json.dumps({"token_ids": prompt}).encode()
            dt, first, c = until(b, body, lambda v: v > 0)
            status, answer, _ = a.call("POST", f"/route/{route_id}/release", b"{}")
            assert status == 200, answer
            dt2, first2, c2 = until(b, body, lambda v: v == 0)
            if i >= args.warmup:
                placed.append(dt)
                ended.append(dt2)
                calls += c + c2
                first_placed += first
                first_ended += first2
        n = args.rounds
        p, e = stats(placed), stats(ended)
        return {
            "transport": args.transport,
            "auth": "CURVE (peer key)" if auth == "key" else "none (trusted_network)",
            "rounds": n,
            "placed_p50_us": p["p50"] * 1e6,
            "placed_p99_us": p["p99"] * 1e6,
            "ended_p50_us": e["p50"] * 1e6,
            "ended_p99_us": e["p99"] * 1e6,
            "first_ask_placed": first_placed / n,
            "first_ask_ended": first_ended / n,
            "b_route_p50_us": stats(calls)["p50"] * 1e6,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300, help="measured placements")
    ap.add_argument("--warmup", type=int, default=30, help="unmeasured placements first")
    ap.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")
    ap.add_argument("--auth", choices=["key", "none", "both"], default="both")
    args = ap.parse_args()
    for auth in ("key", "none") if args.auth == "both" else (args.auth,):
        report(run(args, auth))


def report(r: dict[str, Any]) -> None:
    print(
        f"replica sync over {r['transport']}, authentication {r['auth']}: {r['rounds']} "
        "placements on A, each watched from B"
    )
    print("| event | p50 us | p99 us | B's first ask already showed it |")
    print("|---|---|---|---|")
    for ev in ("placed", "ended"):
        print(
            f"| {ev} | {r[ev + '_p50_us']:.0f} | {r[ev + '_p99_us']:.0f} | "
            f"{100 * r['first_ask_' + ev]:.0f} % |"
        )
    print(
        f"(B's /route itself: p50 {r['b_route_p50_us']:.0f} us; each delay includes at least one)"
    )


if __name__ == "__main__":
    main()
