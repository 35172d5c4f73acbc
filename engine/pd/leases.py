"""The prefill engine's leases: the blocks it holds for a decode engine to pull.

vLLM pins a finished prefill's blocks for ``kv_lease_duration`` (30 s) and frees them when the
decode worker has read them or the lease ran out (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``). Here a
lease is a reference on each block (the allocator cannot reuse it), keyed by the transfer id (the
prefill request's id, vLLM's ``remote_request_id``); the first pull takes it, whatever its
outcome, so a transfer is read at most once. Owned by the engine thread, like the blocks.

Bounded twice, because the peers decide how many prefills arrive and whether a decode engine ever
pulls: at most ``max_blocks`` blocks and ``max_leases`` leases at once (a new lease releases the
oldest ones first, so a prefill engine whose decode peers vanished never runs out of blocks), and a lease
larger than that is not granted at all (the prefill answer then carries no params and the
router prefills on the decode worker).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.pd.params import KvTransferError

__all__ = ["Lease", "LeaseTable"]


@dataclass(frozen=True)
class Lease:
    transfer_id: str
    #: the prefill engine's GPU blocks of the prompt's first full blocks, in order
    block_ids: tuple[int, ...]
    #: the engine hashes of those blocks (the decode engine checks them against its prompt)
    hashes: tuple[int, ...]
    num_tokens: int
    cached_tokens: int
    expires: float


class LeaseTable:
    def __init__(
        self,
        release: Callable[[tuple[int, ...]], None],
        *,
        lease_s: float,
        max_blocks: int,
        max_leases: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0 or max_blocks < 0:
            raise ValueError("lease_s must be > 0 and max_blocks >= 0")
        self._release = release
        self.lease_s = lease_s
        self.max_blocks = max_blocks
        self.max_leases = max_leases
        self.clock = clock
        self._leases: OrderedDict[str, Lease] = OrderedDict()  # oldest first
        self.num_blocks = 0
        #: leases granted since the start
        self.granted = 0
        #: leases ended, by how: pulled, expired, evicted (the bound), refused (too large)
        self.ended: dict[str, int] = {"pulled": 0, "expired": 0, "evicted": 0, "refused": 0}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._leases

    def grant(
        self,
        transfer_id: str,
        block_ids: tuple[int, ...],
        hashes: tuple[int, ...],
        *,
        num_tokens: int,
        cached_tokens: int,
        hold: Callable[[tuple[int, ...]], None],
    ) -> Lease | None:
        """Hold ``block_ids`` (``hold`` takes the references) under a new lease; None if the
        lease alone would exceed the bound."""
        if transfer_id in self._leases:
            raise KvTransferError(f"transfer {transfer_id!r} is already leased", "bad_params")
        if len(block_ids) > self.max_blocks:
            self.ended["refused"] += 1
            return None
        self.expire()
        while self._leases and (
            self.num_blocks + len(block_ids) > self.max_blocks
            or len(self._leases) >= self.max_leases
        ):
            self._end(next(iter(self._leases)), "evicted")
        hold(block_ids)
        lease = Lease(
            transfer_id, block_ids, hashes, num_tokens, cached_tokens, self.clock() + self.lease_s
        )
        self._leases[transfer_id] = lease
        self.num_blocks += len(block_ids)
        self.granted += 1
        return lease

    def take(self, transfer_id: str) -> Lease:
        """The lease, removed from the table (its blocks still held: the caller reads them,
        then calls :meth:`done`); :class:`KvTransferError` if unknown, taken or expired."""
        self.expire()
        lease = self._leases.pop(transfer_id, None)
        if lease is None:
            raise KvTransferError(
                f"unknown transfer {transfer_id!r}: never leased here, already pulled, or its "
                f"lease ({self.lease_s:g} s) ended",
                "unknown_transfer",
            )
        self.num_blocks -= len(lease.block_ids)
        return lease

    def done(self, lease: Lease) -> None:
        """Release a taken lease's blocks."""
        self.ended["pulled"] += 1
        self._release(lease.block_ids)

    def expire(self) -> int:
        """End every lease past its time; how many ended."""
        now, n = self.clock(), 0
        while self._leases:
            tid, lease = next(iter(self._leases.items()))
            if lease.expires > now:
                break
            self._end(tid, "expired")
            n += 1
        return n

    def clear(self) -> None:
        for tid in list(self._leases):
            self._end(tid, "evicted")

    def _end(self, transfer_id: str, how: str) -> None:
        lease = self._leases.pop(transfer_id)
        self.num_blocks -= len(lease.block_ids)
        self.ended[how] += 1
        self._release(lease.block_ids)
