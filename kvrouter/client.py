"""``kvrouter route`` and ``kvrouter workers``: a running router asked, its answer as a table.

- ``kvrouter route BODY``: the dry run — the same OpenAI body (completions or chat) POSTed to
  ``/route`` (which reads ``prompt``/``messages``/``token_ids``, ``model``, ``lora_name``,
  ``cache_salt`` and ignores the rest); every candidate with its rank, matched blocks per tier,
  predicted blocks, load and cost, the pick marked ``*``. Without ``"account": true`` nothing is
  held, but the pick counts as a placement (its predicted blocks), as a proxied one would.
- ``kvrouter workers``: ``GET /workers``, the registry: each worker's URL, role, event stream
  state, lag, seconds since its last message, blocks per tier and requests in flight.

Keys, never on the command line (``ps`` shows it to every local user): the admin key from
``KVROUTER_ADMIN_KEY`` (the variable the router reads) or ``--admin-key-file``; a client key
for ``/route`` when the router has ``api_keys``, from ``OPENAI_API_KEY`` (the OpenAI clients'
variable; a ``KVROUTER_*`` name would be a router setting, and a router refuses one it does not
know) or ``--api-key-file``. Either file is read as the router reads its own (the first key of
an ``api_keys_file``). A failure is one line on stderr and exit status 1; usage errors 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvrouter.up import UpError
from router.errors import ConfigError
from router.settings.keyfiles import read_key_files

__all__ = ["AskError", "events_state", "main", "route_table", "workers_table"]

DEFAULT_URL = "http://127.0.0.1:8000"
_TIERS = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")  # (indexer.events.CANONICAL_TIERS' order)


class AskError(UpError):
    """A running router could not be asked: not reachable, a key refused, an error answer."""


def _parser(cmd: str) -> argparse.ArgumentParser:
    if cmd == "route":
        p = argparse.ArgumentParser(
            prog="kvrouter route",
            description="Where would the router send this request, and why: the OpenAI body "
            "POSTed to /route (a dry run), every candidate worker as a table, the pick marked *.",
            epilog="The client key (when the router has api_keys): OPENAI_API_KEY or "
            '--api-key-file. Example: kvrouter route \'{"model": "m", "prompt": "Hello"}\'',
        )
        p.add_argument(
            "body",
            nargs="?",
            help="the request's JSON body (completions or chat, or /route's own), @FILE for a "
            "file's, - for stdin's",
        )
        p.add_argument("--prompt", help="instead of a body: this text as the prompt")
        p.add_argument("--model", help="with --prompt: the model (default: none)")
        p.add_argument("--api-key-file", metavar="PATH", help="the client key from this file")
    else:
        p = argparse.ArgumentParser(
            prog="kvrouter workers",
            description="The router's workers (GET /workers): URL, role, event stream state, "
            "lag, seconds since the last event message, blocks per tier, requests in flight.",
            epilog="The admin key: KVROUTER_ADMIN_KEY or --admin-key-file.",
        )
        p.add_argument("--admin-key-file", metavar="PATH", help="the admin key from this file")
    p.add_argument("--url", default=DEFAULT_URL, help=f"the router's URL (default {DEFAULT_URL})")
    p.add_argument("--json", action="store_true", help="print the router's JSON answer instead")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds (10)")
    return p


def main(cmd: str, argv: Sequence[str]) -> int:
    """``kvrouter route`` (``cmd`` "route") or ``kvrouter workers``; the exit status."""
    args = _parser(cmd).parse_args(list(argv))
    try:
        if cmd == "route":
            body = _body(args)
            key = _key(args.api_key_file, "api_keys_file", "OPENAI_API_KEY")
            answer, headers = _ask(args.url, "POST", "/route", key, args.timeout, body)
            out = json.dumps(answer, indent=2) if args.json else route_table(answer, headers)
        else:
            key = _key(args.admin_key_file, "admin_key_file", "KVROUTER_ADMIN_KEY")
            answer, _ = _ask(args.url, "GET", "/workers", key, args.timeout)
            out = json.dumps(answer, indent=2) if args.json else workers_table(answer["workers"])
    except (AskError, ConfigError) as e:
        print(f"kvrouter {cmd}: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _body(args: argparse.Namespace) -> bytes:
    if args.prompt is not None:
        if args.body is not None:
            raise AskError("give a body or --prompt, not both")
        return json.dumps({"model": args.model, "prompt": args.prompt}).encode()
    if args.body is None:
        raise AskError("no request: give its JSON body (or @FILE, or - for stdin) or --prompt")
    if args.body == "-":
        text = sys.stdin.read()
    elif args.body.startswith("@"):
        try:
            text = Path(args.body[1:]).read_text()
        except OSError as e:
            raise AskError(f"cannot read {args.body[1:]}: {e.strerror or e}") from None
    else:
        text = args.body
    try:
        json.loads(text)
    except ValueError as e:
        raise AskError(f"the body is not JSON: {e}") from None
    return text.encode()


def _key(path: str | None, setting: str, env: str) -> str | None:
    """The key from ``path`` (read as the router reads its ``setting`` file), else ``env``."""
    if path is None:
        return os.environ.get(env) or None
    got = read_key_files({setting: path})
    return got["admin_key"] if setting == "admin_key_file" else got["api_keys"][0]


_CLIENT_HINT = "give a client key in OPENAI_API_KEY or --api-key-file"
_HINTS = {
    "/route": _CLIENT_HINT,
    "/v1/completions": _CLIENT_HINT,
    "/workers": "give the admin key in KVROUTER_ADMIN_KEY or --admin-key-file",
}


def _ask(
    url: str,
    method: str,
    path: str,
    key: str | None,
    timeout: float,
    body: bytes | None = None,
    *,
    headers: Mapping[str, str] | None = None,
) -> tuple[Any, Mapping[str, str]]:
    """The router's JSON answer to one request (``headers``: more to send), and its headers;
    :class:`AskError` otherwise."""
    headers = {"content-type": "application/json", **(headers or {})}
    if key:
        headers["authorization"] = f"Bearer {key}"
    where = url.rstrip("/") + path
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as c:
            resp = c.request(method, where, content=body, headers=headers)
    except httpx.TimeoutException:
        raise AskError(f"{where}: no answer in {timeout:g} s") from None
    except httpx.HTTPError as e:  # (refused, no such host, not HTTP)
        reason = str(e) or type(e).__name__
        raise AskError(
            f"cannot reach the router at {url}: {reason} (is it running? its address: --url)"
        ) from None
    try:
        answer = resp.json()
    except ValueError:
        answer = None
    if resp.status_code != 200:
        err = answer.get("error") if isinstance(answer, dict) else None
        message = err.get("message") if isinstance(err, dict) else resp.text[:200].strip()
        line = f"{path}: {resp.status_code} {message}"
        if resp.status_code == 401 and path in _HINTS:  # (403: the router's message says)
            line += f" ({_HINTS[path]})"
        raise AskError(line)
    if answer is None:
        raise AskError(f"{path}: the answer is not JSON (is {url} a kvrouter router?)")
    return answer, resp.headers


def _fmt(x: float) -> str:
    return f"{x:.1f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [head, *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


def route_table(answer: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """``/route``'s answer as a table, best first: the pick marked ``*``, the unhealthy last
    (``!``); columns for the tiers any candidate matched on. ``load``: blocks held by requests
    running there plus blocks queued to prefill."""
    cands = list(answer["candidates"])
    tiers = [t for t in _TIERS if any(c["matched_by_tier"].get(t) for c in cands)]
    tiers += sorted(
        {t for c in cands for t, m in c["matched_by_tier"].items() if m and t not in _TIERS}
    )
    picked = (answer["worker_id"], answer["dp_rank"])
    cands.sort(key=lambda c: (not c["healthy"], c["cost"]))
    head = ["", "worker", "rank", "matched", *tiers, "predicted", "load", "cost"]
    rows = []
    for c in cands:
        mark = "*" if (c["worker_id"], c["dp_rank"]) == picked else "" if c["healthy"] else "!"
        load = c["active_blocks"] + c["inflight_prefill_blocks"]
        rows.append(
            [
                mark,
                c["worker_id"],
                str(c["dp_rank"]),
                str(c["matched_blocks"]),
                *(str(c["matched_by_tier"].get(t, 0)) for t in tiers),
                str(c["predicted_blocks"]),
                _fmt(load),
                _fmt(c["cost"]),
            ]
        )
    n, bs = answer["request_blocks"], answer["block_size"]
    out = [f"request: {n} full blocks of {bs} tokens; pick: {answer['worker_id']}"]
    pd = headers.get("x-kvrouter-pd")
    if pd:
        prefill = headers.get("x-kvrouter-prefill-worker")
        reason = headers.get("x-kvrouter-pd-reason", "")
        out[0] += f" (pd {pd}{', prefill on ' + prefill if prefill else ''}: {reason})"
    out.append(_table(head, rows))
    out.append("(* the pick; ! unhealthy; load and cost in blocks, lower cost wins)")
    return "\n".join(out)


def events_state(w: Mapping[str, Any]) -> str:
    """One word for a worker's event streams (the worst of its ranks'): ``live``; ``none``
    (not subscribed); ``disconnected``; ``replaying`` (catching up after joining or a gap);
    ``untrusted`` (its entries dropped after lost events, until a replay); ``stale`` (nothing
    for ``health.stale_events_s``); ``waiting`` (not ready yet)."""
    subs = [r["subscriber"] for r in w["ranks"]]
    if any(s is None for s in subs):
        return "none"
    if not all(s["connected"] for s in subs):
        return "disconnected"
    if any(s["replaying"] or not s["replay_done"] for s in subs):
        return "replaying"
    if not all(s["trusted"] for s in subs):
        return "untrusted"
    if w.get("events_stale"):
        return "stale"
    return "live" if w.get("ready") else "waiting"


def workers_table(workers: Sequence[Mapping[str, Any]]) -> str:
    """``/workers``' answer as a table: one row a worker (its ranks summed; lag: the largest)."""
    head = ["id", "url", "role", "health", "events", "lag_s", "last_s", "blocks", "inflight"]
    rows = []
    for w in workers:
        subs = [r["subscriber"] for r in w["ranks"] if r["subscriber"] is not None]
        lags = [s["lag_s"] for s in subs if s["lag_s"] is not None]
        blocks: dict[str, int] = {}
        for s in subs:
            for t, m in s["blocks_by_tier"].items():
                blocks[t] = blocks.get(t, 0) + m
        since = w["seconds_since_last_event"]
        rows.append(
            [
                w["id"],
                w["url"],
                w["role"],
                "ok" if w["healthy"] else "down",
                events_state(w),
                _fmt(max(lags)) if lags else "-",
                _fmt(since) if since is not None else "-",
                " ".join(f"{t}:{m}" for t, m in blocks.items() if m) or "0",
                str(w["inflight_requests"]),
            ]
        )
    if not rows:
        return "no workers"
    return _table(head, rows)
