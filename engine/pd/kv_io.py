"""Block bytes out of the prefill engine's GPU pool and into the decode engine's, through the
runner's host staging slots (the same path DISK and EXTERNAL blocks take: ``swap_out`` +
``read_host`` on one side, ``write_host`` + ``swap_in`` on the other), so both runners move their
own bytes: the torch runner real KV tensors, the sim runner its self-checking payloads (a digest
chained over the prefix's tokens, which its next step verifies before attending to them).

Runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.offload import LoadItem, TierManager
from engine.pd.params import KvTransferError
from engine.tiers import BlockMeta

__all__ = ["REMOTE", "export_blocks", "stage_blocks"]

#: the source "tier" of a load-back of pulled blocks (never published: they land on GPU)
REMOTE = "REMOTE"


def export_blocks(tiers: TierManager, block_ids: Sequence[int]) -> list[bytes]:
    """The KV bytes of GPU blocks, in order, copied out through free staging slots (as many at
    once as are free; the copies complete before this returns)."""
    host = tiers.host
    out: list[bytes] = []
    while len(out) < len(block_ids):
        slots: list[int] = []
        while host is not None and len(out) + len(slots) < len(block_ids):
            slot = host.take_staging()
            if slot is None:
                break
            slots.append(slot)
        if not slots:
            raise KvTransferError(
                "no free staging slot to copy the blocks out (--staging-blocks)", "no_staging"
            )
        try:
            chunk = block_ids[len(out) : len(out) + len(slots)]
            tiers.runner.swap_out(list(zip(chunk, slots))).wait()
            out.extend(tiers.runner.read_host(s) for s in slots)
        finally:
            assert host is not None
            for s in slots:
                host.give_staging(s)
    return out


def stage_blocks(
    tiers: TierManager, metas: Sequence[BlockMeta], blobs: Sequence[bytes]
) -> list[LoadItem]:
    """Pulled blocks written into free staging slots, ready for :meth:`TierManager.start_load`;
    stops where the staging slots run out (the rest of the prompt is then computed here)."""
    host = tiers.host
    items: list[LoadItem] = []
    for meta, blob in zip(metas, blobs):
        slot = host.take_staging() if host is not None else None
        if slot is None:
            break
        try:
            tiers.runner.write_host(slot, blob)
        except Exception:
            assert host is not None
            host.give_staging(slot)
            raise
        items.append(LoadItem(meta, REMOTE, slot))
    return items
