"""``kv_transfer_params`` as vLLM's NixlConnector puts them on the wire (vLLM 0.32, measured:
shared/research/pd-peers.md §1), the engine's roles and its KV-load failure policies.

A prefill leg carries ``{"do_remote_decode": true, ...}``; the prefill engine answers with
``do_remote_prefill: true`` and where the blocks are (``remote_engine_id``, ``remote_request_id``,
``remote_block_ids``, ``remote_host``/``remote_port``, ``remote_num_tokens``...); the router passes
those verbatim to the decode engine, which pulls the blocks.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "FAILURE_REASONS",
    "LOAD_FAILURE_POLICIES",
    "ROLES",
    "KVTransferParams",
    "KvTransferError",
    "prefill_answer",
]

#: ``--role``: ``both`` serves whole requests and either leg (vLLM's ``kv_both``)
ROLES = ("prefill", "decode", "both")
#: vLLM's ``kv_load_failure_policy``: answer 500 (its default), or prefill on the decode engine
LOAD_FAILURE_POLICIES = ("fail", "recompute")


#: why a transfer failed: the ``reason`` label of the engine's PD counters (engine.metrics)
FAILURE_REASONS = (
    "bad_params",  # kv_transfer_params that cannot name a transfer for this prompt
    "unknown_transfer",  # never leased, already pulled, or its lease ended
    "restarted",  # another epoch of the prefill engine (remote_engine_id)
    "block_mismatch",  # block ids, counts or sizes other than the lease's or this engine's
    "wrong_kv",  # another model or layout (fingerprint), or the KV of other tokens
    "unreachable",  # no connection, or it broke, or a malformed or oversized frame
    "timeout",
    "refused",  # the prefill engine answered with an error (its own reason is counted there)
    "no_staging",  # no free host staging slot to copy the blocks through
)


class KvTransferError(RuntimeError):
    """A transfer that cannot be made: unknown, expired or already pulled transfer id, another
    engine epoch, blocks that do not fit the prompt, a prefill engine gone mid-pull. ``reason``
    is one of :data:`FAILURE_REASONS`."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=False):
    """vLLM's fields; unknown ones are ignored (vLLM adds some between versions)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    #: one list of block ids per tensor-parallel rank of the prefill engine (here: one)
    remote_block_ids: list[Any] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    remote_prefill_cached_tokens: int = 0
    tp_size: int = 1


def prefill_answer(
    *,
    engine_id: str,
    request_id: str,
    block_ids: list[int],
    host: str,
    port: int,
    num_tokens: int,
    cached_tokens: int,
    expiry: float | None,
) -> dict[str, object]:
    """The prefill answer's ``kv_transfer_params``, field for field vLLM 0.32's."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [block_ids],
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": expiry,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached_tokens,
    }
