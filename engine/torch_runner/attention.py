"""Paged attention over the block pool: writing new K/V into their slots and attending each
sequence's queries to every token its block table covers.

Pool layout, one tensor per layer: ``[2, num_blocks, block_size, kv_heads, head_dim]`` (K then V),
so ``pool[0].view(-1, kv_heads, head_dim)`` addresses a token slot ``block * block_size + offset``
directly. The portable path gathers a sequence's blocks (one gather per layer, cut to its context)
and calls ``torch.nn.functional.scaled_dot_product_attention``: decode-only steps run as one
batch, prefill chunks run per sequence. Where queries are the suffix of their context (a chunk
after a cached prefix; a decode batch whose sequences all hold the same context) the causal rule
is ``causal_lower_right``, never a dense mask: on CUDA a mask rules out flash and the
memory-efficient kernel takes no GQA, which leaves the math path or repeated KV heads, while the
bias goes to flash directly (native GQA, split-KV for a few queries over a long context). Only a
decode batch of mixed lengths still pads and masks. A faster CUDA path may replace
:func:`paged_attention` later behind the same signature; none is wired in while no GPU kernel
(Triton) is available.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

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
    decode_ctx: int | None  # the decode sequences' common context length, None if they differ
    decode_bias: CausalBias | None  # causal_lower_right(1, decode_ctx) on CUDA when it is set
    decode_tokens: torch.Tensor | None  # [Bd] long: row of each decode query in the flat batch
    last_token_idx: torch.Tensor  # [B] long: row of each sequence's last new token
    #: per sequence: the causal bias of a multi-token chunk after a cached prefix, else None
    #: (built once per step rather than once per layer: it is a tensor subclass)
    prefix_bias: list[CausalBias | None]

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
    decode_tables = decode_mask = decode_tokens = decode_ctx = decode_bias = None
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
        if len({ctx_lens[i] for i in decode_idx}) == 1:
            decode_ctx = ctx_lens[decode_idx[0]]
            # the bias masks nothing; it only steers CUDA to flash (see paged_attention), and
            # elsewhere SDPA would materialize it: there no mask at all is the cheaper equal
            decode_bias = causal_lower_right(1, decode_ctx) if dev.type == "cuda" else None
    prefix_bias = [
        causal_lower_right(n, ctx) if 1 < n < ctx else None for n, ctx in zip(q_lens, ctx_lens)
    ]
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
        decode_ctx=decode_ctx,
        decode_bias=decode_bias,
        last_token_idx=last.to(dev),
        prefix_bias=prefix_bias,
    )


def store_kv(pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Write new tokens' K and V (``[T, kv_heads, head_dim]``) into their pool slots."""
    kv_heads, head_dim = pool.shape[-2], pool.shape[-1]
    pool[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(pool.dtype))
    pool[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(pool.dtype))


def _gather(pool: torch.Tensor, table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K and V as ``[1, kv_heads, ctx, head_dim]``: one gather of whole blocks, then
    views (the tail past ``ctx`` is cut off, not masked)."""
    kv_heads, head_dim = pool.shape[-2], pool.shape[-1]
    kv = pool.index_select(1, table).reshape(2, -1, kv_heads, head_dim)[:, :ctx]
    kv = kv.transpose(1, 2)  # [2, kv_heads, ctx, head_dim]
    return kv[0].unsqueeze(0), kv[1].unsqueeze(0)


def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """SDPA over ``[B, heads, n, hd]`` queries and ``[B, kv_heads, ctx, hd]`` keys/values, with
    SDPA's own GQA when there are fewer KV heads than query heads."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _prefill(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    pool: torch.Tensor,
    meta: AttentionMetadata,
    i: int,
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    """Sequence ``i``'s output ``[n, heads, head_dim]``, its queries attending causally to its whole
    context."""
    s, n, ctx = meta.q_starts[i], meta.q_lens[i], meta.ctx_lens[i]
    qi = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
    if ctx == n:
        ki = k_new[s : s + n].transpose(0, 1).unsqueeze(0).to(q.dtype)
        vi = v_new[s : s + n].transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=n > 1, scale=scale, enable_gqa=gqa)
    else:
        ki, vi = _gather(pool, meta.block_tables[i], ctx)
        # lower-right causal bias, not a dense [n, ctx] mask: on CUDA (half types) this runs flash
        # directly, with native GQA and split-KV, so a short chunk over a long prefix costs its
        # read of the prefix, not a masked kernel over repeated KV heads (nor a cuDNN graph per
        # shape); where flash cannot run (CPU, float32) SDPA materializes the same mask itself
        o = F.scaled_dot_product_attention(
            qi,
            ki.to(q.dtype),
            vi.to(q.dtype),
            attn_mask=meta.prefix_bias[i],
            scale=scale,
            enable_gqa=gqa,
        )
    return o[0].transpose(0, 1)


def _decode(
    qd: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float, gqa: bool
) -> torch.Tensor:
    """The decode sequences' output ``[Bd, heads, head_dim]`` for their queries ``qd`` (same
    shape), each attending to its whole context."""
    assert meta.decode_tables is not None
    bsz, width = meta.decode_tables.shape
    kv_heads, head_dim = pool.shape[-2], pool.shape[-1]
    kv = pool[:, meta.decode_tables]  # [2, B, width, block_size, kv_heads, hd]
    kv = kv.reshape(2, bsz, width * meta.block_size, kv_heads, head_dim)
    if meta.decode_ctx is not None:
        # every sequence holds the same context (batch 1 always): cut the padding off rather than
        # mask it. The lower-right bias of one query masks nothing; on CUDA it sends SDPA straight
        # to flash (native GQA, split-KV) instead of through the backend priority, which on sm90
        # puts cuDNN first in recent torch, and cuDNN builds a graph per context length: per step
        kv = kv[:, :, : meta.decode_ctx].transpose(2, 3)  # [2, B, kv_heads, ctx, hd]
        k, v = kv[0].to(qd.dtype), kv[1].to(qd.dtype)
        o = F.scaled_dot_product_attention(
            qd.unsqueeze(2), k, v, attn_mask=meta.decode_bias, scale=scale, enable_gqa=gqa
        )
    else:
        kv = kv.transpose(2, 3)
        k, v = kv[0].to(qd.dtype), kv[1].to(qd.dtype)
        o = masked_sdpa(qd.unsqueeze(2), k, v, meta.decode_mask, scale)
    return o.squeeze(2)


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
    gqa = q.shape[1] != pool.shape[-2]
    # a step of one prefill, or of decodes only (their rows are then 0..B-1 in order), needs no
    # output buffer to scatter into: one copy and one or two launches less per layer
    if not meta.decode_idx and len(meta.prefill_idx) == 1:
        return _prefill(q, k_new, v_new, pool, meta, meta.prefill_idx[0], scale, gqa)
    if not meta.prefill_idx:
        return _decode(q, pool, meta, scale, gqa)
    out = torch.empty_like(q)
    for i in meta.prefill_idx:
        s, n = meta.q_starts[i], meta.q_lens[i]
        out[s : s + n] = _prefill(q, k_new, v_new, pool, meta, i, scale, gqa)
    if meta.decode_idx:
        assert meta.decode_tokens is not None
        rows = meta.decode_tokens
        out.index_copy_(0, rows, _decode(q.index_select(0, rows), pool, meta, scale, gqa))
    return out
