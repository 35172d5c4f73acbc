"""Paged attention over the block pool: writing new K/V into their slots and attending each
sequence's queries to every token its block table covers.

Pool layout, one tensor per layer: ``[2, num_blocks, block_size, kv_heads, head_dim]`` (K then V),
so ``pool[0].view(-1, kv_heads, head_dim)`` addresses a token slot ``block * block_size + offset``
directly. The portable path gathers a sequence's blocks and calls
``torch.nn.functional.scaled_dot_product_attention``: decode-only steps run as one padded batch,
prefill chunks run per sequence with a causal mask offset by the cached prefix. A faster CUDA path
may replace :func:`paged_attention` later behind the same signature; none is wired in while no GPU
kernel (Triton) is available.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionMetadata",
    "SeqSpan",
    "build_metadata",
    "masked_sdpa",
    "paged_attention",
    "store_kv",
]


@dataclass(frozen=True)
class SeqSpan:
    """One scheduled sequence in a step: tokens ``[num_computed, num_computed + num_new)`` are
    computed now; ``block_table`` covers at least ``num_computed + num_new`` tokens."""

    num_computed: int
    num_new: int
    block_table: Sequence[int]


@dataclass
class AttentionMetadata:
    block_size: int
    q_starts: list[int]
    q_lens: list[int]
    ctx_lens: list[int]  # tokens held in KV once this step has written its new tokens
    slot_mapping: torch.Tensor  # [T] long: flat slot of each new token
    positions: torch.Tensor  # [T] long: absolute position of each new token
    block_tables: list[torch.Tensor]  # per sequence, long, only the blocks ctx_len needs
    decode_idx: list[int]  # sequences with exactly one new token and a cached context
    prefill_idx: list[int]  # everything else, attended one sequence at a time
    decode_tables: torch.Tensor | None  # [Bd, max_blocks] long, padded with block 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool
    decode_tokens: torch.Tensor | None  # [Bd] long: row of each decode query in the flat batch
    last_token_idx: torch.Tensor  # [B] long: row of each sequence's last new token

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_metadata(
    spans: Sequence[SeqSpan], block_size: int, device: torch.device | str
) -> AttentionMetadata:
    """Plan one step's attention; index tensors are built on the host and moved once."""
    q_starts: list[int] = []
    q_lens: list[int] = []
    ctx_lens: list[int] = []
    slots: list[torch.Tensor] = []
    poss: list[torch.Tensor] = []
    tables_host: list[torch.Tensor] = []
    start = 0
    for span in spans:
        if span.num_new <= 0:
            raise ValueError("every scheduled sequence needs at least one new token")
        ctx = span.num_computed + span.num_new
        nblocks = -(-ctx // block_size)
        if len(span.block_table) < nblocks:
            raise ValueError(
                f"block table has {len(span.block_table)} blocks, {nblocks} needed for {ctx} tokens"
            )
        table = torch.as_tensor(list(span.block_table[:nblocks]), dtype=torch.long)
        pos = torch.arange(span.num_computed, ctx, dtype=torch.long)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        poss.append(pos)
        tables_host.append(table)
        q_starts.append(start)
        q_lens.append(span.num_new)
        ctx_lens.append(ctx)
        start += span.num_new
    decode_idx = [i for i, s in enumerate(spans) if s.num_new == 1 and s.num_computed > 0]
    prefill_idx = [i for i, s in enumerate(spans) if not (s.num_new == 1 and s.num_computed > 0)]
    dev = torch.device(device)
    decode_tables = decode_mask = decode_tokens = None
    if decode_idx:
        width = max(len(tables_host[i]) for i in decode_idx)
        padded = torch.zeros(len(decode_idx), width, dtype=torch.long)
        for row, i in enumerate(decode_idx):
            padded[row, : len(tables_host[i])] = tables_host[i]
        lens = torch.tensor([ctx_lens[i] for i in decode_idx], dtype=torch.long)
        mask = torch.arange(width * block_size)[None, :] < lens[:, None]
        decode_tables = padded.to(dev)
        decode_mask = mask[:, None, None, :].to(dev)
        decode_tokens = torch.tensor([q_starts[i] for i in decode_idx], dtype=torch.long).to(dev)
    last = torch.tensor([s + n - 1 for s, n in zip(q_starts, q_lens)], dtype=torch.long)
    return AttentionMetadata(
        block_size=block_size,
        q_starts=q_starts,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        slot_mapping=torch.cat(slots).to(dev) if slots else torch.empty(0, dtype=torch.long),
        positions=torch.cat(poss).to(dev) if poss else torch.empty(0, dtype=torch.long),
        block_tables=[t.to(dev) for t in tables_host],
        decode_idx=decode_idx,
        prefill_idx=prefill_idx,
        decode_tables=decode_tables,
        decode_mask=decode_mask,
        decode_tokens=decode_tokens,
        last_token_idx=last.to(dev),
    )


def store_kv(pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Write new tokens' K and V (``[T, kv_heads, head_dim]``) into their pool slots."""
    kv_heads, head_dim = pool.shape[-2], pool.shape[-1]
    pool[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(pool.dtype))
    pool[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(pool.dtype))


def _gather(pool: torch.Tensor, table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K and V as ``[1, kv_heads, ctx, head_dim]``."""
    kv_heads, head_dim = pool.shape[-2], pool.shape[-1]
    kv = pool[:, table].reshape(2, -1, kv_heads, head_dim)[:, :ctx]
    kv = kv.transpose(1, 2)  # [2, kv_heads, ctx, head_dim]
    return kv[0].unsqueeze(0), kv[1].unsqueeze(0)


def _offset_causal_mask(q_len: int, ctx: int, device: torch.device) -> torch.Tensor:
    """Query i (absolute position ctx - q_len + i) sees keys 0..ctx - q_len + i."""
    rows = torch.arange(q_len, device=device)[:, None] + (ctx - q_len)
    return torch.arange(ctx, device=device)[None, :] <= rows


def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    expand_kv: bool = False,
) -> torch.Tensor:
    """SDPA over ``[B, heads, n, hd]`` queries and ``[B, kv_heads, ctx, hd]`` keys/values, GQA
    either native or (``expand_kv``) by repeating each KV head for its query-head group."""
    groups = q.shape[1] // k.shape[1]
    if expand_kv and groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention output ``[T, heads, head_dim]`` for queries ``q`` ``[T, heads, head_dim]``.

    ``k_new``/``v_new`` are this step's keys and values, already written to ``pool``; a sequence
    without a cached prefix attends to them directly instead of gathering them back.
    """
    out = torch.empty_like(q)
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = pool.shape[-2]
    gqa = heads != kv_heads
    for i in meta.prefill_idx:
        s, n, ctx = meta.q_starts[i], meta.q_lens[i], meta.ctx_lens[i]
        qi = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
        if ctx == n:
            ki = k_new[s : s + n].transpose(0, 1).unsqueeze(0).to(q.dtype)
            vi = v_new[s : s + n].transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=n > 1, scale=scale, enable_gqa=gqa
            )
        else:
            ki, vi = _gather(pool, meta.block_tables[i], ctx)
            mask = _offset_causal_mask(n, ctx, q.device) if n > 1 else None
            # CUDA's masked (memory-efficient) kernel takes no GQA: without expanding the KV heads
            # SDPA would fall back to math and materialize [heads, n, ctx] scores
            expand = gqa and mask is not None and q.is_cuda
            o = masked_sdpa(qi, ki.to(q.dtype), vi.to(q.dtype), mask, scale, expand_kv=expand)
        out[s : s + n] = o[0].transpose(0, 1)
    if meta.decode_idx:
        assert meta.decode_tables is not None and meta.decode_tokens is not None
        rows = meta.decode_tokens
        bsz, width = meta.decode_tables.shape
        kv = pool[:, meta.decode_tables]  # [2, B, width, block_size, kv_heads, hd]
        kv = kv.reshape(2, bsz, width * meta.block_size, kv_heads, head_dim).transpose(2, 3)
        qd = q.index_select(0, rows).unsqueeze(2)  # [B, heads, 1, hd]
        o = F.scaled_dot_product_attention(
            qd,
            kv[0].to(q.dtype),
            kv[1].to(q.dtype),
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=gqa,
        )
        out.index_copy_(0, rows, o.squeeze(2))
    return out
