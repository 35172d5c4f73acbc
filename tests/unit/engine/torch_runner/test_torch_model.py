"""The paged decoder against the plain unpaged forward, on the test device in each test dtype.

Tolerance (``PAGED_TOL``): logits agree to ``atol=1e-4`` in float32 (logits are O(1..10),
reduction order differs between the paged and dense paths by ~1e-6); bfloat16 (CUDA) is looser.
"""

from __future__ import annotations

import pytest
import torch
from torch_helpers import BLOCK, DEVICE, DTYPES, PAGED_TOL, dtype_name, prompt

from engine.torch_runner.attention import SeqSpan, build_metadata, masked_sdpa
from engine.torch_runner.kv_pool import KVPool
from engine.torch_runner.loader import load_model

SPECS = {
    "llama": "tiny-random:layers=2,d=64,heads=4,kv_heads=2,vocab=97,seed=1",
    "qwen2": "tiny-random:layers=2,d=64,heads=4,kv_heads=1,vocab=97,arch=qwen2,seed=2",
    "mha": "tiny-random:layers=1,d=64,heads=2,kv_heads=2,vocab=97,seed=3",
}


def _setup(arch: str, dtype: torch.dtype = torch.float32, blocks: int = 48):
    lm = load_model(SPECS[arch], device=DEVICE, dtype=dtype_name(dtype))
    assert lm.dtype == dtype
    pool = KVPool(
        lm.config,
        num_blocks=blocks,
        block_size=BLOCK,
        num_host_slots=0,
        device=DEVICE,
        dtype=dtype,
    )
    return lm.model, pool


def _ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, device=DEVICE)


def _run(model, pool, ids, spans, rows=None):
    meta = build_metadata(spans, BLOCK, DEVICE)
    rows_t = None if rows is None else _ids(rows)
    return model(_ids(ids), pool.layers, meta, rows_t)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("arch", list(SPECS))
def test_full_prefill_matches_dense_forward_at_every_position(arch, dtype):
    model, pool = _setup(arch, dtype)
    ids = prompt(37, seed=1)
    ref = model.reference_logits(_ids(ids))
    table = [7, 3, 30, 11, 2, 9, 20, 21, 22, 23]  # scattered blocks: paging must not matter
    got = _run(model, pool, ids, [SeqSpan(0, 37, table)], rows=list(range(37)))
    torch.testing.assert_close(got, ref, **PAGED_TOL[dtype])
    written = pool.gpu.abs().sum(dim=(0, 1, 3, 4, 5)) > 0
    assert written.nonzero().flatten().tolist() == sorted(table)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("cached", [4, 8, 7, 13, 35])  # on and off block boundaries
def test_prefill_over_cached_prefix_matches_full_prefill(arch, cached, dtype):
    model, pool = _setup(arch, dtype)
    ids = prompt(36, seed=2)
    full_table = list(range(0, 9))
    full = _run(model, pool, ids, [SeqSpan(0, len(ids), full_table)])
    # a second sequence shares the first full blocks of the cached prefix, owns the rest; the
    # partial block (prefix off a boundary) is recomputed into its own block (copy-on-write)
    shared = cached // BLOCK
    table = full_table[:shared] + list(range(20, 20 + 9 - shared))
    start = shared * BLOCK
    if start < cached:  # fill the tokens before `cached` in its own partial block first
        _run(model, pool, ids[start:cached], [SeqSpan(start, cached - start, table)])
    got = _run(model, pool, ids[cached:], [SeqSpan(cached, len(ids) - cached, table)])
    torch.testing.assert_close(got, full, **PAGED_TOL[dtype])
    ref = model.reference_logits(_ids(ids))[-1:]
    torch.testing.assert_close(got, ref, **PAGED_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_mixed_batch_of_prefills_and_decodes_matches_each_alone(dtype):
    model, pool = _setup("llama", dtype, blocks=64)
    a, b, c = prompt(9, seed=3), prompt(17, seed=4), prompt(22, seed=5)
    ta, tb, tc = [1, 2, 3], [10, 11, 12, 13, 14], [30, 31, 32, 33, 34, 35]
    # a and b have their prompt minus one token in the pool; c arrives with a cached prefix of 8
    _run(model, pool, a[:-1], [SeqSpan(0, 8, ta)])
    _run(model, pool, b[:-1], [SeqSpan(0, 16, tb)])
    _run(model, pool, c[:8], [SeqSpan(0, 8, tc)])
    spans = [SeqSpan(8, 1, ta), SeqSpan(8, 14, tc), SeqSpan(16, 1, tb)]
    got = _run(model, pool, [a[-1], *c[8:], b[-1]], spans)
    for row, ids in enumerate((a, c, b)):
        ref = model.reference_logits(_ids(ids))[-1]
        torch.testing.assert_close(got[row], ref, **PAGED_TOL[dtype])


def test_slot_mapping_and_decode_plan():
    meta = build_metadata(
        [SeqSpan(6, 1, [5, 9]), SeqSpan(0, 3, [4]), SeqSpan(2, 3, [7, 8])], BLOCK, DEVICE
    )
    # planned on the host, moved once: every index tensor the forward reads is on the device
    tensors = [meta.slot_mapping, meta.positions, meta.last_token_idx, *meta.block_tables]
    tensors += [meta.decode_tables, meta.decode_mask, meta.decode_tokens]
    assert {t.device.type for t in tensors if t is not None} == {torch.device(DEVICE).type}
    assert meta.slot_mapping.tolist() == [9 * 4 + 2, 16, 17, 18, 30, 31, 32]
    assert meta.positions.tolist() == [6, 0, 1, 2, 2, 3, 4]
    assert meta.decode_idx == [0] and meta.prefill_idx == [1, 2]
    assert meta.decode_mask is not None and meta.decode_mask[0, 0, 0].tolist() == [True] * 7 + [
        False
    ]
    assert meta.last_token_idx.tolist() == [0, 3, 6]
    with pytest.raises(ValueError, match="block table"):
        build_metadata([SeqSpan(3, 2, [1])], BLOCK, DEVICE)


def test_masked_gqa_matches_kv_heads_repeated_per_group():
    # masked_sdpa's native GQA against the reference: each KV head repeated for its query-head
    # group, under the dense causal mask of 5 queries at the end of a 12-token context
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 16, generator=gen).to(DEVICE)
    k, v = torch.randn(2, 1, 2, 12, 16, generator=gen).to(DEVICE)
    rows = torch.arange(5, device=q.device)[:, None] + (12 - 5)
    mask = torch.arange(12, device=q.device)[None, :] <= rows
    atol = 1e-6 if q.device.type == "cpu" else 1e-5
    native = masked_sdpa(q, k, v, mask, 0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask, scale=0.25
    )
    torch.testing.assert_close(native, ref, atol=atol, rtol=0)
    # query head 5 belongs to KV head 1 (groups of 3)
    alone = masked_sdpa(q[:, 5:6], k[:, 1:2], v[:, 1:2], mask, 0.25)
    torch.testing.assert_close(native[:, 5:6], alone, atol=atol, rtol=0)
