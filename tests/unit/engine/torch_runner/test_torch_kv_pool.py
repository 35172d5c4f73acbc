"""The KV pool's host side: block copies device <-> host and slot bytes, exact to the bit (on
CUDA through the side stream and pinned host memory)."""

from __future__ import annotations

import pytest
import torch
from torch_helpers import DEVICE

from engine.torch_runner.config import parse_model_spec
from engine.torch_runner.kv_pool import KVPool, _runs

CFG = parse_model_spec("tiny-random:layers=3,d=32,heads=4,kv_heads=2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_and_bytes_round_trip_exactly(dtype):
    pool = KVPool(CFG, num_blocks=10, block_size=4, num_host_slots=6, device=DEVICE, dtype=dtype)
    assert pool.host.device.type == "cpu" and pool.host.is_pinned() == (pool.device.type == "cuda")
    pool.gpu.copy_(torch.randn(pool.gpu.shape, generator=torch.Generator().manual_seed(0)))
    original = pool.gpu.clone()
    out = pool.copy_out([(3, 0), (7, 1), (1, 4)])
    out.wait()  # a no-op on CPU, where copies complete on return
    assert out.done() and out.elapsed_s >= 0
    assert torch.equal(pool.host[1], original[:, :, 7].cpu())
    blob = pool.export_slot(4)
    assert len(blob) == pool.block_bytes == 3 * 2 * 4 * 2 * 8 * dtype.itemsize
    pool.import_slot(5, blob)
    pool.gpu.zero_()
    back = pool.copy_in([(5, 9), (0, 2), (1, 8)])
    back.wait()
    assert back.done()
    assert torch.equal(pool.gpu[:, :, 9], original[:, :, 1])
    assert torch.equal(pool.gpu[:, :, 2], original[:, :, 3])
    assert torch.equal(pool.gpu[:, :, 8], original[:, :, 7])
    assert pool.gpu[:, :, [0, 1, 3, 4, 5, 6, 7]].abs().sum() == 0  # nothing else written
    pool.copy_device([(9, 0)])
    assert torch.equal(pool.gpu[:, :, 0], original[:, :, 1])
    with pytest.raises(ValueError, match="expected"):
        pool.import_slot(0, blob[:-2])


def test_consecutive_slots_group_into_runs():
    assert _runs([(0, 5), (1, 6), (2, 7), (3, 2), (5, 3)]) == [(0, 5, 3), (3, 2, 1), (5, 3, 1)]
    assert _runs([]) == []
