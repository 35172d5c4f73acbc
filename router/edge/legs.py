"""The exchange between a disaggregated request's two legs, per protocol (``pd.protocol``,
docs/architecture.md §10): what each leg's body changes from the client's (:class:`LegPatch`),
the one definition the proxy executes and ``POST /route`` hands to a gateway that carries the
bytes itself.

- ``nixl`` (vLLM's NixlConnector, pull, sequential): the prefill leg asks for one token, not
  streamed, with ``kv_transfer_params`` saying "decode elsewhere"; its answer's
  ``kv_transfer_params`` go verbatim, with the client's own body, to the decode worker.
- ``sglang`` (SGLang's bootstrap, concurrent): both legs get ``bootstrap_host`` and
  ``bootstrap_port`` (the prefill worker's) and one ``bootstrap_room``; both are sent at once.
- ``shared_storage`` (vLLM's ExampleConnector): the prefill leg as ``nixl``'s without params;
  the decode worker finds the KV by the prompt.

A client never steers a transfer: a body carrying one of :data:`STEERING` is refused (400) by the
front door, so every transfer target comes from the worker registry.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

import msgspec

from router.errors import BadRequest
from router.placement import Choice, Pick

__all__ = [
    "NIXL_PREFILL",
    "STEERING",
    "LegOut",
    "LegPatch",
    "PdOut",
    "answer_params",
    "apply",
    "bootstrap",
    "check_unsteered",
    "decode_patch",
    "prefill_patch",
    "route_legs",
]

#: body fields that direct a KV transfer: set by the router only
STEERING = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
#: SGLang's default bootstrap port (``--disaggregation-bootstrap-port``)
SGLANG_BOOTSTRAP_PORT = 8998
#: what vLLM's prefill worker reads to keep the blocks for a remote decode (toy_proxy_server.py);
#: never mutated (each leg takes a copy)
NIXL_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_ONE_TOKEN = {"max_tokens": 1, "max_completion_tokens": 1, "stream": False}
_NOT_ON_PREFILL = ["stream_options", "min_tokens"]
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode


class LegPatch(msgspec.Struct, omit_defaults=True):
    """How one leg's body differs from the client's: keys ``set``, keys removed, and keys taken
    from the prefill leg's answer (the decode leg of ``nixl``)."""

    set: dict[str, Any] = msgspec.field(default_factory=dict)
    remove: list[str] = msgspec.field(default_factory=list)
    from_prefill: list[str] = msgspec.field(default_factory=list)


class LegOut(msgspec.Struct):
    """One leg in ``POST /route``'s answer: where it goes and how its body differs from the
    client's (:class:`LegPatch`'s three fields)."""

    leg: str  # prefill | decode
    worker_id: str
    dp_rank: int
    url: str
    matched_blocks: int
    set: dict[str, Any]
    remove: list[str]
    from_prefill: list[str]
    #: sent at the same time as the other leg (SGLang), or after it (vLLM)
    concurrent: bool = False


class PdOut(msgspec.Struct):
    """``POST /route``'s ``pd``: the decision, its reason, and each leg to execute."""

    decision: str  # local | remote
    reason: str
    protocol: str
    #: the prefill worker of a remote decision
    prefill: LegOut | None
    uncached_decode_tokens: int
    uncached_prefill_tokens: int
    legs: list[LegOut]


def route_legs(pick: Pick, protocol: str, rng: random.Random) -> PdOut:
    """A disaggregated pick as ``POST /route`` answers it: a gateway that carries the bytes
    executes the legs in order (or at once when ``concurrent``)."""
    dc = pick.decode
    legs: list[LegOut] = []
    p = pick.prefill
    concurrent = protocol == "sglang"
    d_patch = LegPatch()
    if p is not None:
        fields = bootstrap(p, rng) if concurrent else None
        legs.append(_leg_out("prefill", p, prefill_patch(protocol, fields), concurrent))
        d_patch = decode_patch(protocol, fields)
    legs.append(_leg_out("decode", dc, d_patch, concurrent and p is not None))
    first = legs[0] if p is not None else None
    return PdOut(
        pick.mode, pick.reason, protocol, first, pick.uncached_decode, pick.uncached_prefill, legs
    )


def _leg_out(leg: str, c: Choice, patch: LegPatch, concurrent: bool) -> LegOut:
    key = c.cand.key
    return LegOut(
        leg,
        key[0],
        key[1],
        c.worker.url,
        c.cand.matched_blocks,
        patch.set,
        patch.remove,
        patch.from_prefill,
        concurrent,
    )


def check_unsteered(req: Any) -> None:
    """400 for a decoded OpenAI body that sets a transfer field (:data:`STEERING`)."""
    for name in STEERING:
        if getattr(req, name, None) is not None:
            raise BadRequest(f"{name}: set by the router, a client may not send it", param=name)


def bootstrap(prefill: Choice, rng: random.Random) -> dict[str, Any]:
    """SGLang's fields for a pair: the prefill worker's host and bootstrap port, and a room
    that is ≡ its data-parallel rank modulo its ranks (SGLang's prefill picks the rank so)."""
    cfg = prefill.worker.config
    dp, rank = cfg.dp_ranks, prefill.cand.key[1]
    room = (rng.getrandbits(63) // dp) * dp + rank
    return {
        "bootstrap_host": urlsplit(cfg.url).hostname or "",
        "bootstrap_port": cfg.bootstrap_port or SGLANG_BOOTSTRAP_PORT,
        "bootstrap_room": room,
    }


def prefill_patch(protocol: str, fields: dict[str, Any] | None = None) -> LegPatch:
    """The prefill leg's patch (``fields``: SGLang's bootstrap fields)."""
    if protocol == "sglang":
        return LegPatch(set=dict(fields or {}))
    patch = LegPatch(set=dict(_ONE_TOKEN), remove=list(_NOT_ON_PREFILL))
    if protocol == "nixl":
        patch.set["kv_transfer_params"] = dict(NIXL_PREFILL)
    return patch


def decode_patch(protocol: str, fields: dict[str, Any] | None = None) -> LegPatch:
    """The decode leg's patch: ``nixl`` takes the prefill answer's ``kv_transfer_params``."""
    if protocol == "sglang":
        return LegPatch(set=dict(fields or {}))
    if protocol == "nixl":
        return LegPatch(from_prefill=["kv_transfer_params"])
    return LegPatch()


def apply(body: bytes, patch: LegPatch, prefill_answer: dict[str, Any] | None = None) -> bytes:
    """The client's body with ``patch`` applied (key order kept; new keys last)."""
    obj = _decode(body)
    for k in patch.remove:
        obj.pop(k, None)
    obj.update(patch.set)
    if prefill_answer is not None:
        for k in patch.from_prefill:
            obj[k] = prefill_answer.get(k)
    return _encode(obj)


def answer_params(content: bytes) -> dict[str, Any] | None:
    """The prefill answer's ``kv_transfer_params`` (a JSON object), or None."""
    try:
        obj = _decode(content)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    params = obj.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None
