"""The block pull's wire (engine.pd.wire) over a real socket: every size a peer controls is
bounded before it is read, and the bound fits what an honest prefill engine sends."""

from __future__ import annotations

import pytest

from engine.pd.params import KvTransferError
from engine.pd.side_channel import BlockEndpoint, pull
from engine.pd.wire import PullAnswer, PullRequest


async def test_a_long_prompts_pull_of_its_last_blocks_fits_and_a_bloated_answer_does_not() -> None:
    # a 191k-token prompt (synthetic trace) is ~12,000 blocks: the answer carries every block's
    # hash (108 KB) beside the few blocks the decode engine lacks; the bound counted only those
    # blocks and 64 KB, and refused the pull as "a frame of 108273 bytes, over the 66832"
    n, held = 12_000, 11_976
    hashes = [(1 << 63) + i for i in range(n)]  # 9 bytes each in msgpack, the widest

    async def export(req: PullRequest) -> PullAnswer:
        size = 8 if req.transfer_id == "ok" else 64 * 1024
        return PullAnswer(block_hashes=hashes, blocks=[b"k" * size] * (n - req.first))

    ep = await BlockEndpoint(export, host="127.0.0.1", port=0).start()
    try:
        req = PullRequest(engine_id="e", transfer_id="ok", block_ids=list(range(n)), first=held)
        got = await pull("127.0.0.1", ep.port, req, block_bytes=8, timeout=10)
        assert len(got.blocks) == n - held and got.block_hashes == hashes
        # what the decode engine did not ask for is never read: 24 blocks of 64 KB, not 8 B
        req = PullRequest(engine_id="e", transfer_id="big", block_ids=list(range(n)), first=held)
        with pytest.raises(KvTransferError, match="over the") as exc:
            await pull("127.0.0.1", ep.port, req, block_bytes=8, timeout=10)
        assert exc.value.reason == "unreachable"
    finally:
        await ep.close()
