"""PD benchmark: the latency kvrouter adds to a disaggregated (prefill/decode) request, against
the latency it adds to an aggregated one, measured side by side in one run.

Run (nothing else should be running; times on the 2-core dev machine):

    python benchmarks/bench_pd.py                          # sequential, non-streamed (~25 s)
    python benchmarks/bench_pd.py --stream --concurrency 1 4   # + streamed, + 4 clients (~80 s)
    taskset -c 0 python benchmarks/bench_pd.py             # every process on one core

Issue 34's target: the latency the PD path adds over its two legs sent directly is within twice
the proxy's own overhead, at p50 and at p99.

Everything is real and on 127.0.0.1: two workers (``benchmarks/pd_worker.py prefill`` /
``decode``: a bare uvloop + httptools server with fixed answers, no model, and a KV event socket
that publishes nothing) speak vLLM's NIXL exchange (``shared/research/pd-peers.md`` §1): the
prefill worker answers a leg carrying ``kv_transfer_params.do_remote_decode`` with one token and
its own ``kv_transfer_params``, the decode worker takes a leg carrying them (or a plain request).
Two routers (``python -m router``, each its own process) front them: one with the pair
(``role=prefill`` / ``role=decode``, ``KVROUTER_PD__MODE=always``), one with the decode worker
alone as an aggregated ``both`` worker. The same request bodies (a ``--prompt-chars`` prompt,
``max_tokens`` 16) go four ways, interleaved (each cycle in a rotated order) and paced at
``--rate`` requests/s, one at a time over keep-alive connections (a raw-socket HTTP/1.1 client):

- (a) direct PD: the client sends the prefill leg (the body the router sends P: ``max_tokens``
  1, ``stream`` false, ``kv_transfer_params`` asking for a remote decode) to P, then the
  client's body with P's ``kv_transfer_params`` to D; the latency is the two calls' sum (the
  client builds the decode body between them, untimed);
- (b) the client's body through the PD router;
- (c) direct aggregated: the client's body to D;
- (d) the client's body through the aggregated router: the proxy's own overhead is (d) - (c).

Before measuring, the bodies the router sent each worker are checked to equal (a)'s, and its
answer to say ``x-kvrouter-pd: remote``. Reported per round (median round shown, as
``bench_route.py`` does): p50/p99 of each way, PD added = (b) - (a), proxy overhead = (d) - (c)
(differences of percentiles), and their ratio; target ratio <= 2. The PNG (latency CDFs) goes
to ``benchmarks/out/bench_pd.png``.

``--concurrency K`` (K > 1): K client threads, each on its own connections, unpaced; each runs the
same rotating cycle. The client's own Python time then counts more in (a), which makes two calls:
read its PD-added figure as a lower bound.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from children import Children  # noqa: E402
from pd_client import Client, get  # noqa: E402
from pd_worker import MODEL  # noqa: E402

WAYS = ("a", "b", "c", "d")
NAMES = {
    "a": "(a) direct PD, P leg + D leg",
    "b": "(b) via kvrouter, PD",
    "c": "(c) direct aggregated, D",
    "d": "(d) via kvrouter, aggregated",
}
#: what the router puts in the prefill leg (``router.edge.legs``; vLLM's toy_proxy_server.py)
NIXL_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_enc = msgspec.json.Encoder().encode
_dec = msgspec.json.Decoder(dict[str, Any]).decode


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


# --------------------------------------------------------------------------- the four ways


def request_bodies(prompt_chars: int, stream: bool, count: int = 32) -> list[bytes]:
    """The client's bodies: ``count`` distinct prompts of ``prompt_chars`` characters."""
    out = []
    for k in range(count):
        prompt = "".join(chr(97 + (i * 7919 + k * 104729) % 26) if i % 6 else " "
                         for i in range(prompt_chars))  # fmt: skip
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 16}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        out.append(_enc(body))
    return out


def prefill_body(body: bytes) -> bytes:
    """The prefill leg, as ``router.edge.legs.prefill_patch("nixl")`` makes it."""
    obj = _dec(body)
    for k in ("stream_options", "min_tokens"):
        obj.pop(k, None)
    obj.update(max_tokens=1, max_completion_tokens=1, stream=False, kv_transfer_params=NIXL_PREFILL)
    return _enc(obj)


def decode_body(body: bytes, answer: bytes) -> bytes:
    """The decode leg: the client's body and the prefill answer's ``kv_transfer_params``."""
    obj = _dec(body)
    obj["kv_transfer_params"] = _dec(answer)["kv_transfer_params"]
    return _enc(obj)


class Ways:
    """One client's connections: ``run(way, i)`` sends body ``i`` that way, its seconds."""

    PATH = "/v1/completions"

    def __init__(self, urls: dict[str, str], bodies: list[bytes]) -> None:
        self.p, self.d = Client(urls["p"]), Client(urls["d"])
        self.pd, self.agg = Client(urls["pd"]), Client(urls["agg"])
        self.bodies = bodies
        self.prefills = [prefill_body(b) for b in bodies]

    def close(self) -> None:
        for c in (self.p, self.d, self.pd, self.agg):
            c.close()

    def _ok(self, got: tuple[int, bytes, bytes, float], what: str) -> tuple[bytes, bytes, float]:
        if got[0] != 200:
            raise RuntimeError(f"{what}: HTTP {got[0]}: {got[2][:300]!r}")
        return got[1], got[2], got[3]

    def run(self, way: str, i: int) -> float:
        body = self.bodies[i % len(self.bodies)]
        if way == "a":
            leg = self.prefills[i % len(self.bodies)]
            _, answer, t1 = self._ok(self.p.post(self.PATH, leg), "P")
            d_body = decode_body(body, answer)  # (untimed: between the two calls)
            return t1 + self._ok(self.d.post(self.PATH, d_body), "D")[2]
        c = {"b": self.pd, "c": self.d, "d": self.agg}[way]
        return self._ok(c.post(self.PATH, body), way)[2]


def check(urls: dict[str, str], bodies: list[bytes]) -> None:
    """The PD router sent P and D exactly (a)'s two bodies, and said it disaggregated."""
    w = Ways(urls, bodies[:1])
    try:
        _check(w, urls, bodies)
    finally:
        w.close()


def _check(w: Ways, urls: dict[str, str], bodies: list[bytes]) -> None:
    head, routed, _ = w._ok(w.pd.post(w.PATH, bodies[0]), "PD router")
    assert b"x-kvrouter-pd: remote" in head.lower(), head
    assert b"x-kvrouter-prefill-worker: p0" in head.lower(), head
    p_got, d_got = _dec(get(urls["p"], "/last")[1]), _dec(get(urls["d"], "/last")[1])
    _, answer, _ = w._ok(w.p.post(w.PATH, w.prefills[0]), "P")
    assert p_got == _dec(w.prefills[0]), (p_got, w.prefills[0])
    assert d_got == _dec(decode_body(bodies[0], answer)), d_got
    _, direct, _ = w._ok(w.d.post(w.PATH, decode_body(bodies[0], answer)), "D")
    assert routed == direct
    head, _, _ = w._ok(w.agg.post(w.PATH, bodies[0]), "aggregated router")
    assert b"x-kvrouter-pd" not in head.lower(), head
    assert _dec(get(urls["d"], "/last")[1]) == _dec(bodies[0])


def measure(
    urls: dict[str, str], bodies: list[bytes], concurrency: int, seconds: float, rate: float
) -> dict[str, list[float]]:
    """One round: every way's latencies, interleaved; paced at ``rate`` when sequential."""
    out: dict[str, list[float]] = {w: [] for w in WAYS}
    lock = threading.Lock()
    stop = time.perf_counter() + seconds
    errors: list[BaseException] = []

    def client(k: int) -> None:
        try:
            ways = Ways(urls, bodies)
            try:
                run(k, ways)
            finally:
                ways.close()
        except BaseException as e:  # (a thread's exception would be lost)
            errors.append(e)

    def run(k: int, ways: Ways) -> None:
        mine: dict[str, list[float]] = {w: [] for w in WAYS}
        for i in range(40):  # each connection's first answers: warm
            ways.run(WAYS[i % 4], i)
        t0, i = time.perf_counter(), 0
        while True:
            if concurrency == 1:
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            if time.perf_counter() > stop:
                break
            cycle = i // 4 + k
            way = WAYS[(i + cycle) % 4]  # each cycle in a rotated order
            mine[way].append(ways.run(way, i))
            i += 1
        with lock:
            for w in WAYS:
                out[w] += mine[w]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def summarize(rounds: list[dict[str, list[float]]]) -> list[tuple[str, list[tuple[float, float]]]]:
    """Rows: each way's per-round (p50, p99), PD added, proxy overhead, and their ratio."""
    per = {w: [(pct(r[w], 0.5), pct(r[w], 0.99)) for r in rounds] for w in WAYS}
    added = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(per["a"], per["b"])]
    over = [(d[0] - c[0], d[1] - c[1]) for c, d in zip(per["c"], per["d"])]
    ratio = [(x[0] / max(y[0], 1e-9), x[1] / max(y[1], 1e-9)) for x, y in zip(added, over)]
    rows = [(NAMES[w], per[w]) for w in WAYS]
    rows += [("PD added, (b) - (a)", added), ("proxy overhead, (d) - (c)", over)]
    rows.append(("ratio, added / overhead", ratio))
    return rows


def print_table(title: str, rows: list[tuple[str, list[tuple[float, float]]]], n: int) -> bool:
    """The table; True when the ratio meets the target at p50 and p99 (median round)."""
    print(f"\n{title} ({n} requests per way per round)")
    print(f"{'measure':<34}{'p50':>10}{'p99':>10}   per round p50/p99 (us)")
    ok = True
    for name, per in rows:
        p50 = statistics.median(x[0] for x in per)
        p99 = statistics.median(x[1] for x in per)
        if name.startswith("ratio"):
            each = "  ".join(f"{a:.2f}/{b:.2f}" for a, b in per)
            ok = p50 <= 2 and p99 <= 2
            verdict = "meets" if ok else "MISSES"
            print(f"{name:<34}{p50:>9.2f}x{p99:>9.2f}x   {each}   target <= 2x: {verdict}")
        else:
            each = "  ".join(f"{a * 1e6:.0f}/{b * 1e6:.0f}" for a, b in per)
            print(f"{name:<34}{p50 * 1e6:>8.0f}us{p99 * 1e6:>8.0f}us   {each}")
    return ok


def plot(path: str, runs: list[tuple[str, list[dict[str, list[float]]]]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (title, rounds) in zip(axes[0], runs):
        for w in WAYS:
            s = sorted(x * 1e6 for r in rounds for x in r[w])
            ax.plot(s, [i / len(s) for i in range(len(s))], label=NAMES[w])
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("latency (us)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"\nplot: {path}")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> bool:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0, help="time per round")
    ap.add_argument("--rate", type=float, default=200.0, help="sequential requests per second")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (median reported)")
    ap.add_argument("--prompt-chars", type=int, default=1000)
    ap.add_argument("--stream", action="store_true", help="streamed requests too")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--router-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more settings for both routers")  # fmt: skip
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "out" / "bench_pd.png"))
    args = ap.parse_args(argv)
    me = [sys.executable, str(ROOT / "benchmarks" / "pd_worker.py")]
    ready = r"worker (http://\S+) events=(\S+)"
    env = dict(kv.split("=", 1) for kv in args.router_env)
    env.update(KVROUTER_PD__MODE="always", KVROUTER_PD__PROTOCOL="nixl")
    runs: list[tuple[str, list[dict[str, list[float]]]]] = []
    tables = []
    with Children("bench-pd") as kids:

        def started(
            label: str, argv: list[str], pattern: str, env: dict[str, str] | None = None
        ) -> re.Match[str]:
            return kids.spawn(label, argv, env).wait_line(re.compile(pattern), 60, kids.stop)

        pm = started("prefill", [*me, "prefill"], ready)
        dm = started("decode", [*me, "decode"], ready)
        urls = {"p": pm.group(1), "d": dm.group(1)}
        router = [sys.executable, "-m", "router", "--port", "0", "--log-level", "warning"]
        listening = r"listening on (http://\S+)"
        fleets = {
            "pd": ["--worker", f"id=p0,url={urls['p']},events={pm.group(2)},role=prefill",
                   "--worker", f"id=d0,url={urls['d']},events={dm.group(2)},role=decode"],
            "agg": ["--worker", f"id=d0,url={urls['d']},events={dm.group(2)}"],
        }  # fmt: skip
        for name, workers in fleets.items():
            urls[name] = started(f"router-{name}", [*router, *workers], listening, env).group(1)
        deadline = time.monotonic() + 60
        while any(get(urls[n], "/ready")[0] != 200 for n in fleets):
            if time.monotonic() > deadline:
                raise SystemExit("the routers never became ready")
            time.sleep(0.05)
        for stream in (False, True) if args.stream else (False,):
            bodies = request_bodies(args.prompt_chars, stream)
            check(urls, bodies)
            for k in args.concurrency:
                measure(urls, bodies, k, 1.0, args.rate)  # warm-up round
                rounds = [
                    measure(urls, bodies, k, args.seconds, args.rate) for _ in range(args.rounds)
                ]
                kind = "streamed" if stream else "non-streamed"
                how = "sequential" if k == 1 else f"{k} concurrent clients"
                title = f"{kind}, {how}, {args.prompt_chars}-char prompt"
                runs.append((title, rounds))
                tables.append((title, summarize(rounds), min(len(r["a"]) for r in rounds)))
    ok = all([print_table(*t) for t in tables])
    plot(args.plot, runs)
    return ok


if __name__ == "__main__":
    main()
