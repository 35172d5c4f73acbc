"""What an engine server does with the two legs of vLLM's NIXL-pull exchange (``--role``):

* a **prefill leg** (``kv_transfer_params.do_remote_decode``; role ``prefill`` or ``both``): the
  request runs as any other (the router asked for one token), and when it finishes its prompt's
  full blocks are leased (:mod:`engine.pd.leases`); the answer's ``kv_transfer_params`` name them
  and this engine's block endpoint, field for field vLLM's;
* a **decode leg** (``do_remote_prefill``; role ``decode`` or ``both``): before the request is
  submitted, the blocks are pulled from the prefill engine (:func:`engine.pd.side_channel.pull`),
  checked (count, size, fingerprint, and the engine hash of every block against this prompt's:
  the bytes are the KV of *these* tokens), and handed to the engine core, which loads them into
  its own GPU blocks and publishes ``BlockStored(GPU)`` for them, as vLLM 0.32's decode worker
  does. A pull that fails is a :class:`KvTransferError` (``--kv-load-failure-policy fail``, vLLM's
  default: the HTTP answer is a 500) or a local prefill (``recompute``).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.async_engine import AsyncEngine
from engine.block_manager import hash_chain
from engine.config import ServerSettings
from engine.engine import RequestOutput
from engine.pd.params import KvTransferError, KVTransferParams, prefill_answer
from engine.pd.side_channel import BlockEndpoint, advertised_host, pull
from engine.pd.wire import PullAnswer, PullRequest
from engine.sequence import RemoteKV, Request

__all__ = ["PdCounters", "PdNode", "PdRequestError"]

log = logging.getLogger("engine.pd")


class PdRequestError(ValueError):
    """A leg this engine's role does not take, or params that cannot be a leg: a 400."""


@dataclass(frozen=True)
class PdCounters:
    """The PD side's counters since the start, for ``/metrics`` (engine.metrics names them)."""

    #: prefill side: pulls answered with blocks, and refused by reason
    served: int
    refused: dict[str, int]
    #: decode side: pulls done (blocks pulled and checked), failed by reason, then recomputed
    done: int
    failed: dict[str, int]
    recomputed: int
    blocks: int
    bytes: int


class PdNode:
    """The PD side of one engine server: role, epoch (``remote_engine_id``, new at every start,
    so a restarted prefill engine's old transfers are refused), block endpoint, failure policy."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        role: str,
        policy: str,
        host: str,
        port: int,
        pull_timeout_s: float,
        advertise_host: str | None = None,
    ) -> None:
        core = engine.core
        self.engine, self.role, self.policy = engine, role, policy
        self.pull_timeout_s = pull_timeout_s
        self.engine_id = str(uuid.uuid4())
        self.block_size = core.config.block_size
        self.lease_s = core.config.kv_lease_s
        # immutable once built: read here, never on the engine thread's objects later
        self.fingerprint = core.runner.kv_fingerprint
        self.block_bytes = core.runner.kv_block_bytes
        self.seed = core.bm.seed
        self.endpoint = (
            BlockEndpoint(self._export, host=host, port=port) if role != "decode" else None
        )
        self._advertise_host = advertise_host
        #: (host, port) the prefill answers name: decided once, at start (engine.pd.side_channel)
        self.advertised: tuple[str, int] | None = None
        #: decode legs by outcome: pulled, failed (answered 500), recomputed (prefilled here)
        self.pulls: dict[str, int] = {"pulled": 0, "failed": 0, "recomputed": 0}
        #: failed decode legs (answered 500 or recomputed) by engine.pd.params.FAILURE_REASONS
        self.failures: dict[str, int] = {}
        self.pulled_blocks = 0
        self.pulled_bytes = 0

    @classmethod
    def of(cls, engine: AsyncEngine, settings: ServerSettings) -> PdNode:
        """The node an engine server with ``settings`` runs."""
        return cls(
            engine,
            role=settings.role,
            policy=settings.kv_load_failure_policy,
            host=settings.kv_host or settings.host,
            port=settings.kv_port,
            pull_timeout_s=settings.kv_pull_timeout_s,
            advertise_host=settings.kv_advertise_host,
        )

    async def start(self) -> PdNode:
        if self.endpoint is not None:
            ep = await self.endpoint.start()
            self.advertised = (advertised_host(ep.host, self._advertise_host), ep.port)
            log.info("prefill blocks advertised at %s:%d", *self.advertised)
        return self

    async def close(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.close()

    # ------------------------------------------------------------------ both legs

    async def prepare(self, params: KVTransferParams | None, req: Request, stream: bool) -> None:
        """Make ``req`` the leg its params ask for (or leave it a whole request)."""
        if params is None or not (params.do_remote_decode or params.do_remote_prefill):
            return
        if params.do_remote_decode and params.do_remote_prefill:
            raise PdRequestError("kv_transfer_params: do_remote_decode and do_remote_prefill")
        if params.do_remote_decode:
            if self.role == "decode":
                raise PdRequestError("this engine's role is decode: it takes no prefill leg")
            if stream:
                raise PdRequestError("a prefill leg (do_remote_decode) is not streamed")
            req.kv_hold = True
            return
        if self.role == "prefill":
            raise PdRequestError("this engine's role is prefill: it takes no decode leg")
        try:
            req.remote_kv = await self._pull(params, req.prompt_token_ids)
        except KvTransferError as exc:
            self.failures[exc.reason] = self.failures.get(exc.reason, 0) + 1
            if self.policy == "fail":
                self.pulls["failed"] += 1
                raise
            self.pulls["recomputed"] += 1
            log.warning("KV load failed, prefilling here instead: %s", exc)
            return
        self.pulls["pulled"] += 1
        self.pulled_blocks += len(req.remote_kv.blocks)  # those it lacked
        self.pulled_bytes += sum(map(len, req.remote_kv.blocks))

    def answer_params(self, out: RequestOutput) -> dict[str, Any] | None:
        """A finished prefill leg's ``kv_transfer_params`` (None: no lease was granted, and the
        router prefills on the decode worker)."""
        lease = out.kv_lease
        if lease is None or self.advertised is None:
            return None
        return prefill_answer(
            engine_id=self.engine_id,
            request_id=lease.transfer_id,
            block_ids=list(lease.block_ids),
            host=self.advertised[0],
            port=self.advertised[1],
            num_tokens=lease.num_tokens,
            cached_tokens=lease.cached_tokens,
            expiry=time.time() + self.lease_s,
        )

    def snapshot(self) -> dict[str, Any]:
        """For ``GET /debug/kv_transfers``."""
        ep = self.endpoint
        return {
            "role": self.role,
            "engine_id": self.engine_id,
            "endpoint": f"{ep.host}:{ep.port}" if ep else None,  # as bound
            "advertised": "{}:{}".format(*self.advertised) if self.advertised else None,
            "served": ep.served if ep else 0,
            "refused": sum(ep.refused.values()) if ep else 0,
            "pulls": dict(self.pulls),
            "pulled_blocks": self.pulled_blocks,
            "block_bytes": self.block_bytes,
        }

    def counters(self) -> PdCounters:
        ep = self.endpoint
        return PdCounters(
            served=ep.served if ep else 0,
            refused=dict(ep.refused) if ep else {},
            done=self.pulls["pulled"],
            failed=dict(self.failures),
            recomputed=self.pulls["recomputed"],
            blocks=self.pulled_blocks,
            bytes=self.pulled_bytes,
        )

    # ------------------------------------------------------------------ prefill side

    async def _export(self, req: PullRequest) -> PullAnswer:
        if req.engine_id != self.engine_id:
            raise KvTransferError(
                f"engine {req.engine_id!r} is not this one ({self.engine_id}): it restarted",
                "restarted",
            )
        lease, blobs = await self.engine.call(
            lambda core: core.export_lease(req.transfer_id, req.block_ids, req.first)
        )
        return PullAnswer(
            fingerprint=self.fingerprint, block_hashes=list(lease.hashes), blocks=blobs
        )

    # ------------------------------------------------------------------ decode side

    async def _pull(self, p: KVTransferParams, ids: list[int]) -> RemoteKV:
        block_ids = _block_ids(p.remote_block_ids)
        if not (p.remote_engine_id and p.remote_request_id and p.remote_host and p.remote_port):
            raise KvTransferError(
                "kv_transfer_params lack remote_engine_id, remote_request_id, remote_host or "
                "remote_port",
                "bad_params",
            )
        if p.remote_num_tokens != len(ids):
            raise KvTransferError(
                f"the prefill engine prefilled {p.remote_num_tokens} tokens, this prompt has "
                f"{len(ids)}",
                "bad_params",
            )
        k = (len(ids) - 1) // self.block_size
        if len(block_ids) != k:
            raise KvTransferError(
                f"remote_block_ids names {len(block_ids)} blocks; a prompt of {len(ids)} "
                f"tokens has {k} full blocks to pull (block size {self.block_size})",
                "bad_params",
            )
        hashes = hash_chain(self.seed, ids[: k * self.block_size], self.block_size)
        # pull only what this engine lacks (vLLM's decode worker too): its own GPU hit first
        first = await self.engine.call(lambda core: len(core.bm.lookup(hashes)))
        req = PullRequest(
            engine_id=p.remote_engine_id,
            transfer_id=p.remote_request_id,
            block_ids=block_ids,
            first=first,
        )
        answer = await pull(
            p.remote_host,
            p.remote_port,
            req,
            block_bytes=self.block_bytes,
            timeout=self.pull_timeout_s,
        )
        if answer.fingerprint != self.fingerprint:
            raise KvTransferError(
                f"the prefill engine's KV is {answer.fingerprint!r}, this engine's "
                f"{self.fingerprint!r}: another model or layout",
                "wrong_kv",
            )
        if answer.block_hashes != hashes:
            raise KvTransferError(
                "the pulled blocks hold the KV of other tokens than this prompt's", "wrong_kv"
            )
        cached = min(p.remote_prefill_cached_tokens, len(ids))
        return RemoteKV(answer.blocks, first=first, cached_tokens=cached)


def _block_ids(raw: list[Any] | None) -> list[int]:
    """vLLM sends one list per tensor-parallel rank of the prefill engine (this one has one);
    a flat list is taken too."""
    if raw is None:
        raise KvTransferError("kv_transfer_params lack remote_block_ids", "bad_params")
    if raw and isinstance(raw[0], list):
        if len(raw) != 1:
            raise KvTransferError(
                f"remote_block_ids for {len(raw)} ranks; this engine has one", "bad_params"
            )
        raw = raw[0]
    if not all(type(b) is int for b in raw):
        raise KvTransferError("remote_block_ids must be block ids (integers)", "bad_params")
    return list(raw)
