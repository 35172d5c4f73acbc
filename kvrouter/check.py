"""``kvrouter check``: does a running router see its workers as they are? One line per finding,
exit status 1 on a problem (2: usage).

For each worker of the router (``GET /workers``, or those named):

- **health** and **events**: the worker answers its health checks, and its event stream is live
  (``kvrouter workers``' one word for it: not live is a problem: the index goes blind);
- **capacity**: the KV size the worker reported (unknown: a warning, ``WARN``: the index caps its
  entries with a default and the overflow term cannot see it fill);
- **agreement**: a probe — random text, several blocks long, new to every cache — sent twice to
  that worker through the router (pinned: ``x-kvrouter-worker`` with the admin key, so the
  router tokenizes, hashes and accounts it as any request). After the first, the check waits
  for the worker's events to show the prompt stored; then the index's view of that worker from
  its events alone is compared with the cached tokens the second answer reports, by the same
  judge as the closed loop's (:func:`router.placement.agreement.compare`). A worker whose
  tokenizer, block size or hash seed differs from the router's never stores blocks the router's
  hashes match: it reports hits the index never saw, and is named with the likely cause.

Keys as ``kvrouter workers`` and ``kvrouter route`` read them (:mod:`kvrouter.client`): the admin
key from ``KVROUTER_ADMIN_KEY`` or ``--admin-key-file`` (``/workers`` and the pin), the client
key (when the router has ``api_keys``) from ``OPENAI_API_KEY`` or ``--api-key-file``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrouter.client import DEFAULT_URL, AskError, _ask, _key, events_state
from router.errors import ConfigError
from router.placement.agreement import Observation, compare, reusable_tokens

__all__ = ["Findings", "check_worker", "main", "probe_text"]

# words a tokenizer knows as words; the random numbers make the text new to every cache
_WORDS = [
    "router",
    "cache",
    "block",
    "prefix",
    "worker",
    "token",
    "event",
    "index",
    "probe",
    "check",
    "tier",
    "model",
    "stream",
    "answer",
    "request",
    "match",
    "store",
    "remove",
    "replay",
    "capacity",
    "page",
    "hash",
    "seed",
]


def probe_text(words: int, rand: Callable[[int], int] = secrets.randbelow) -> str:
    """``words`` random words and numbers: several blocks in any tokenizer, never seen before."""
    return " ".join(f"{_WORDS[rand(len(_WORDS))]} {rand(100000)}" for _ in range(words // 2))


@dataclass
class Findings:
    """What the check found: ``lines`` in order; ``problems`` counts the ``PROBLEM`` ones."""

    lines: list[str] = field(default_factory=list)
    problems: int = 0

    def ok(self, worker: str, text: str) -> None:
        self.lines.append(f"ok {worker}: {text}")

    def warn(self, worker: str, text: str) -> None:
        self.lines.append(f"WARN {worker}: {text}")

    def problem(self, worker: str, text: str) -> None:
        self.lines.append(f"PROBLEM {worker}: {text}")
        self.problems += 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter check",
        description="Check a running router's workers: health, live KV events, known capacity, "
        "and whether each worker's tokenizer, block size and hash seed agree with the "
        "router's (a probe prompt sent twice, pinned to the worker; the index's prediction "
        "compared with the cached tokens it reports). One line per finding; exit status 1 "
        "on a problem.",
        epilog="The admin key: KVROUTER_ADMIN_KEY or --admin-key-file; the client key (when the "
        "router has api_keys): OPENAI_API_KEY or --api-key-file. Each probe is two short "
        "requests (max_tokens 1) to the worker.",
    )
    p.add_argument("workers", nargs="*", metavar="ID", help="check only these workers")
    p.add_argument("--router", "--url", dest="url", default=DEFAULT_URL, help="the router's URL")
    p.add_argument("--admin-key-file", metavar="PATH", help="the admin key from this file")
    p.add_argument("--api-key-file", metavar="PATH", help="the client key from this file")
    p.add_argument("--probe-words", type=int, default=200, metavar="N", help="probe length (200)")
    p.add_argument(
        "--events-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for a probe's blocks in the worker's events (10)",
    )
    p.add_argument("--no-probe", action="store_true", help="events and capacity only")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="per request (60)")
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    found = Findings()
    try:
        admin = _key(args.admin_key_file, "admin_key_file", "KVROUTER_ADMIN_KEY")
        client = _key(args.api_key_file, "api_keys_file", "OPENAI_API_KEY")
        answer, _ = _ask(args.url, "GET", "/workers", admin, args.timeout)
        workers = answer["workers"]
        known = {w["id"] for w in workers}
        for wid in args.workers:
            if wid not in known:
                found.problem(wid, f"no such worker (the router has: {', '.join(sorted(known))})")
        chosen = [w for w in workers if not args.workers or w["id"] in args.workers]
        if not workers:
            found.problem("router", "no workers")
        for w in chosen:
            check_worker(w, args, admin, client, found)
    except (AskError, ConfigError) as e:
        found.lines.append(f"kvrouter check: {e}")
        found.problems += 1
    for line in found.lines:
        print(line, file=sys.stdout if line.startswith(("ok", "WARN", "PROBLEM")) else sys.stderr)
    return 1 if found.problems else 0


def check_worker(
    w: Mapping[str, Any],
    args: argparse.Namespace,
    admin: str | None,
    client: str | None,
    found: Findings,
) -> None:
    """Every finding for one worker (``w``: its ``GET /workers`` entry) into ``found``."""
    wid = w["id"]
    good: list[str] = []
    if not w["healthy"]:
        found.problem(wid, f"down ({w.get('last_error') or 'failing its health checks'})")
        return
    state = events_state(w)
    if state == "live":
        good.append("events flowing")
    else:
        found.problem(wid, f"events {state}: the index does not follow this worker's cache")
    caps = [r.get("capacity") for r in w["ranks"]]
    if all(caps):
        gpu = sum(c.get("GPU", 0) for c in caps if c)
        good.append(f"capacity {gpu} blocks")
    else:
        found.warn(
            wid, "capacity unknown (its /metrics report no KV size): entries capped by default"
        )
    probed = ""
    if w["role"] == "prefill":
        good.append("a prefill worker: not probed")
    elif not args.no_probe and state == "live":
        try:
            probed = _probe(w, args, admin, client)
        except AskError as e:
            probed = f"PROBLEM the probe failed: {e}"
        if not probed.startswith(("PROBLEM ", "WARN ")):
            good.append(probed)
    if good:
        found.ok(wid, ", ".join(good))
    if probed.startswith("PROBLEM "):
        found.problem(wid, probed.removeprefix("PROBLEM "))
    elif probed.startswith("WARN "):
        found.warn(wid, probed.removeprefix("WARN "))


def _post(
    args: argparse.Namespace, path: str, key: str | None, body: bytes, **headers: str
) -> tuple[Any, Mapping[str, str]]:
    return _ask(args.url, "POST", path, key, args.timeout, body, headers=headers)


def _probe(
    w: Mapping[str, Any], args: argparse.Namespace, admin: str | None, client: str | None
) -> str:
    """The agreement finding: ``prefix agreement A/B blocks``, or ``PROBLEM ...`` / ``WARN ...``."""
    wid = w["id"]
    model = w.get("model") or next(iter(w.get("models") or []), None)
    prompt = f"kvrouter check {secrets.token_hex(4)} " + probe_text(args.probe_words)
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    ).encode()
    pin = {"x-kvrouter-worker": wid, "x-kvrouter-admin-key": admin or ""}
    stored_before = _stored(args, admin, wid)
    _post(args, "/v1/completions", client, body, **pin)
    # (a worker with larger pages is credited whole pages: up to one short of the prompt)
    slack = max([r["page"] for r in w["ranks"]] + [1])
    # the index's view of this worker once its events show the probe stored: every block the
    # worker can reuse, or (a mismatch: its blocks never match the router's) its stored-event
    # count grown and a second passed for the rest of the batch, or the timeout
    deadline = time.monotonic() + args.events_timeout
    grown_at: float | None = None
    while True:
        route, _ = _post(args, "/route", client, body)
        cand = next(c for c in route["candidates"] if c["worker_id"] == wid)
        bs, tokens = route["block_size"], route["prompt_tokens"]
        confirmed = sum(cand["matched_by_tier"].values())
        if confirmed * bs >= reusable_tokens(route["request_blocks"], tokens, bs) - max(bs, slack):
            break
        now = time.monotonic()
        if grown_at is None and _stored(args, admin, wid) > stored_before:
            grown_at = now
        if now >= deadline or (grown_at is not None and now - grown_at >= 1.0):
            break
        time.sleep(0.05)  # (polling a condition: the events land when they land)
    answer, headers = _post(args, "/v1/completions", client, body, **pin)
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    reported = details.get("cached_tokens")
    if reported is None:
        return (
            "WARN reports no cached tokens (usage.prompt_tokens_details; vLLM: "
            "--enable-prompt-tokens-details): agreement not checked"
        )
    rank = int(headers.get("x-kvrouter-dp-rank", "0"))
    cand = next(c for c in route["candidates"] if c["worker_id"] == wid and c["dp_rank"] == rank)
    page = next((r["page"] for r in w["ranks"] if r["dp_rank"] == rank), 0)
    # the events' word alone: the router's own prediction from the first probe (it sent it
    # there) is no evidence of what the worker stored
    obs = Observation(wid, tokens, bs, cand["matched_by_tier"], 0, reported, page)
    c = compare(obs)
    if c.agrees:
        return f"prefix agreement {c.reported // bs}/{c.expected // bs} blocks"
    return (
        f"PROBLEM reports {c.reported} cached tokens where the index predicts {c.expected} "
        f"(likely: {c.likely})"
    )


def _stored(args: argparse.Namespace, admin: str | None, wid: str) -> int:
    """The worker's BlockStored events the router applied so far (all its ranks)."""
    answer, _ = _ask(args.url, "GET", "/workers", admin, args.timeout)
    w = next((x for x in answer["workers"] if x["id"] == wid), None)
    if w is None:
        raise AskError(f"worker {wid} left the router during the check")
    return sum(
        (r["subscriber"] or {}).get("events_by_type", {}).get("BlockStored", 0) for r in w["ranks"]
    )
