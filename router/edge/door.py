"""The one front door of the router's three ways in (docs/architecture.md §10): the OpenAI proxy,
the Envoy endpoint picker and ``POST /route`` all go through here, so a request gets the same
checks, the same pick and the same ``x-kvrouter-*`` headers whichever way it came.

- :func:`authorize`: the router's own client keys (never forwarded to a worker);
- :func:`request_tokens`: an OpenAI body decoded (400/422 for a bad one, 400 for a client that
  tries to steer a KV transfer) and its prompt tokens;
- :func:`enter`: admit (the placement core's in-flight count, 429 past ``proxy.max_inflight``),
  decode, place and pick (503 when no worker can take it), as an :class:`Entry`;
- :func:`pick_headers`: what a pick says to the client; :func:`why` why it went there (opt-in);
- :func:`pinned`: a request the admin pins to one worker (``x-kvrouter-worker``).

The door decides nothing itself: the placement core's :meth:`router.placement.Placer.pick` does;
each door then executes the pick (the proxy's legs: :mod:`router.edge.pd_flow`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

from router.edge.access import WHY_HEADER
from router.edge.bodies import (
    ChatBody,
    CompletionBody,
    check_messages,
    completion_tokens_source,
    decode,
)
from router.edge.legs import check_unsteered
from router.errors import BadRequest, Forbidden, NotFound, Unauthorized, require_bearer
from router.placement import Admission, Choice, Pick, WorkerView
from router.runtime import Runtime

__all__ = [
    "ADMIN_KEY_HEADER",
    "PIN_HEADER",
    "Entry",
    "authorize",
    "enter",
    "pick_headers",
    "pinned",
    "request_tokens",
    "why",
]

#: a request header naming the worker that must serve the request (the answer's header of the
#: same name names the one that did): the admin's, with :data:`ADMIN_KEY_HEADER`
PIN_HEADER = "x-kvrouter-worker"
#: the admin key beside a pin: ``authorization`` may carry the client key (``api_keys``)
ADMIN_KEY_HEADER = "x-kvrouter-admin-key"


def authorize(state: Runtime, authorization: str | None, what: str) -> None:
    """401 unless ``authorization`` carries one of the router's client keys (when set)."""
    keys = state.settings.api_keys
    if keys:
        require_bearer(authorization, keys, what)


def pinned(
    state: Runtime, header: Callable[[str], str | None]
) -> Callable[[WorkerView], bool] | None:
    """The workers a request pinned with ``x-kvrouter-worker: ID`` may go to (its ranks), None
    when not pinned. ``kvrouter check`` probes each worker so: the router then hashes, predicts
    and accounts the request as any other, and compares the worker's reported cache. Only the
    admin may pin (a client choosing its worker defeats the placement, and would learn the
    fleet's ids): the admin key in ``x-kvrouter-admin-key`` (401 without it), unless the admin
    endpoints are open (``admin_open``); 403 with no admin key configured, 404 for an unknown
    worker. A pinned request is never retried elsewhere: only that worker is eligible."""
    worker_id = header(PIN_HEADER)
    if worker_id is None:
        return None
    key = state.settings.admin_key
    if key:
        given = (header(ADMIN_KEY_HEADER) or "").strip().encode()
        if not secrets.compare_digest(given, key.encode()):
            raise Unauthorized(
                f"{PIN_HEADER} (a pinned request) needs {ADMIN_KEY_HEADER}: <admin key>"
            )
    elif not state.settings.admin_open:
        raise Forbidden(
            f"{PIN_HEADER} (a pinned request) is the admin's: configure admin_key (or admin_open: "
            "true on a trusted network)"
        )
    if worker_id not in state.registry.workers:
        raise NotFound(f"no worker {worker_id!r} (its id, as GET /workers lists it)")
    return lambda st: st.config.id == worker_id


async def request_tokens(state: Runtime, endpoint: str, body: bytes) -> tuple[Any, list[int], bool]:
    """A completions or chat body (``endpoint``) decoded, its prompt tokens and whether it
    streams; raises :class:`router.errors.RouterError` (400/422) for a bad body."""
    if endpoint == "completions":
        req: Any = decode(body, CompletionBody)
        check_unsteered(req)
        src = completion_tokens_source(req.prompt)
        if src is None:
            raise BadRequest("prompt is required")
        if isinstance(src, str):
            return req, await state.tokenizer.encode(src, req.model), req.stream
        return req, src, req.stream
    req = decode(body, ChatBody)
    check_unsteered(req)
    if not req.messages:
        raise BadRequest("messages is required")
    check_messages(req.messages)
    return req, await state.tokenizer.encode_chat(req.messages, req.model), req.stream


class Entry:
    """One request through the door: admitted (until :meth:`release`), decoded and picked.
    ``req`` is None for a request with no prompt (the picker's other paths)."""

    __slots__ = ("admission", "body", "endpoint", "pick", "req", "stream")

    def __init__(
        self,
        admission: Admission,
        endpoint: str | None,
        body: bytes,
        req: Any,
        stream: bool,
        pick: Pick,
    ) -> None:
        self.admission = admission
        self.endpoint = endpoint
        self.body = body
        self.req = req
        self.stream = stream
        self.pick = pick

    def release(self) -> None:
        self.admission.release()


async def enter(
    state: Runtime,
    endpoint: str | None,
    body: bytes,
    authorization: str | None,
    *,
    eligible: Callable[[WorkerView], bool] | None = None,
) -> Entry:
    """Authorize, admit, decode, place and pick one OpenAI request (``endpoint``:
    ``completions`` or ``chat``; None: no prompt, the load decides). Raises
    :class:`router.errors.RouterError` (401, 429, 400/422, 404, 503) with nothing held."""
    authorize(state, authorization, "the OpenAI endpoints")
    placer = state.placer
    admission = placer.admit()
    try:
        if endpoint is None:
            req, stream = None, False
            d = placer.place((), None)
        else:
            req, tokens, stream = await request_tokens(state, endpoint, body)
            d = placer.place(
                tokens, req.model, req.lora_name, req.cache_salt, max_tokens=req.output_bound()
            )
        # several answers (n > 1) decode from one prefill on one worker: vLLM's prefill leg
        # would compute one (smg and llm-d keep them whole too)
        whole = req is None or (req.n is not None and req.n > 1)
        pick = placer.pick(d, allow_remote=not whole, eligible=eligible)
    except BaseException:
        admission.release()
        raise
    return Entry(admission, endpoint, body, req, stream, pick)


def pick_headers(
    pick: Pick, serving: Choice | None = None, *, explain: bool = False
) -> list[tuple[str, str]]:
    """The answer headers of a pick, the same from every door: the worker serving the client
    (the decode worker), the blocks of the prompt it holds, and for a disaggregated fleet what
    was decided and why (after a door's fallback: what was done, and its cause).
    ``serving``: the decode worker the door sent to, when not the first (a retry); ``explain``
    (``scoring.explain``): also ``x-kvrouter-why`` (:func:`why`)."""
    dc = serving or pick.decode
    matched = str(dc.cand.matched_blocks)
    out = [
        ("x-kvrouter-worker", dc.worker.id),
        ("x-kvrouter-matched-blocks", matched),
        ("x-kvrouter-cached-blocks", matched),  # deprecated name of the same number
    ]
    if dc.worker.config.dp_ranks > 1:
        out.append(("x-kvrouter-dp-rank", str(dc.cand.key[1])))
    if pick.disaggregated:
        out += [("x-kvrouter-pd", pick.mode), ("x-kvrouter-pd-reason", pick.reason)]
        p = pick.prefill
        if p is not None:
            out.append(("x-kvrouter-prefill-worker", p.worker.id))
        if pick.fallback:
            out.append(("x-kvrouter-pd-fallback", pick.fallback))
    if explain:
        out.append((WHY_HEADER, why(pick, dc)))
    return out


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")  # a tier name is a worker's free text (its events)


def why(pick: Pick, serving: Choice | None = None) -> str:
    """Why the pick went where it did, in one line (``x-kvrouter-why``, the access line's
    ``why``): the serving worker's matched blocks per tier (of the request's full blocks), its
    credit and cost, then the runner-up (the next eligible rank) and by how much it lost::

        worker=b blocks=GPU:12,CPU_PINNED:3 of=20 credit=13.8 cost=4.1; next=a cost=9.7 margin=5.6

    Costs are in blocks of decode work (router.placement.scoring); a negative margin says the
    runner-up cost less and was passed over (a retry, a temperature draw, a replica's lane)."""
    dc = serving or pick.decode
    c = dc.cand
    tiers = ",".join(f"{_UNSAFE.sub('?', t)}:{m}" for t, m in c.by_tier.items() if m)
    text = f"worker={_rank(dc)} blocks={tiers or 0} of={pick.decision.n}"
    if c.predicted_blocks:
        text += f" predicted={c.predicted_blocks}"
    text += f" credit={c.credited:.1f} cost={c.cost:.1f}"
    nxt = next((x for x in pick.decodes if x.cand.key != c.key), None)
    if nxt is not None:
        margin = nxt.cand.cost - c.cost
        text += f"; next={_rank(nxt)} cost={nxt.cand.cost:.1f} margin={margin:.1f}"
    return text


def _rank(ch: Choice) -> str:
    """A worker id, and its rank when it has several (``@``: never in an id)."""
    if ch.worker.config.dp_ranks > 1:
        return f"{ch.worker.id}@{ch.cand.key[1]}"
    return ch.worker.id
