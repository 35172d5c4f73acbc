"""``snapshot_off_loop``: the loop runs between ranks, and each rank is recorded with the seq
read in its own step."""

from __future__ import annotations

import asyncio

from indexer.events import BlockStored
from indexer.index import PrefixIndex
from router.runtime.service import snapshot_off_loop

A, B = ("a", 0), ("b", 0)
T = list(range(8))


async def test_the_loop_runs_between_ranks_and_each_rank_keeps_its_own_seq() -> None:
    idx = PrefixIndex(4)
    for key in (A, B):
        idx.apply_event(key, BlockStored([1], None, T[:4], 4))
    seqs = {A: 0, B: 0}
    ran_between: list[bool] = []

    async def writer() -> None:  # as the subscriber would: a batch and its seq in one step
        for key in (A, B):
            idx.apply_event(key, BlockStored([2], 1, T[4:8], 4))
            seqs[key] = 1
        ran_between.append(True)

    def resume_point(key: tuple[str, int]) -> int:
        if key == B:  # A was read before the writer ran, B after it
            assert ran_between == [True]
        return seqs[key]

    task = asyncio.create_task(writer())
    data = await snapshot_off_loop(idx, resume_point)
    await task
    restored, got = PrefixIndex.from_snapshot_bytes(data)
    assert got == {A: 0, B: 1}
    h = idx.request_hashes(T)
    assert restored.match(h).workers[A].matched_blocks == 1
    assert restored.match(h).workers[B].matched_blocks == 2
    # the same bytes as one step on the loop gives for the same state
    assert data != idx.snapshot_bytes(seqs)  # (A moved on since)
    assert await snapshot_off_loop(idx, seqs.get) == idx.snapshot_bytes(seqs)
