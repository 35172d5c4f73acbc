"""The Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) for Llama and Qwen2.

Parameter names follow Hugging Face's (``model.layers.N.self_attn.q_proj.weight`` ...) so a
checkpoint's state dict loads as is. :meth:`CausalLM.forward` computes a flat batch of new tokens
from several sequences against the paged KV pool; :meth:`CausalLM.reference_logits` is the plain,
unpaged forward over one whole sequence that tests hold the paged path to.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention, store_kv
from .config import ModelConfig

__all__ = ["CausalLM", "RMSNorm", "rope_inv_freq"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in float32 as HF does: bf16 variance loses too much
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with HF's ``llama3`` and ``linear`` scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d, bias = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.scale = self.head_dim**-0.5

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def forward(self, x, cos, sin, pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        store_kv(pool, meta.slot_mapping, k, v)
        o = paged_attention(q, k, v, pool, meta, self.scale)
        return self.o_proj(o.reshape(x.shape[0], -1))

    def forward_dense(self, x, cos, sin) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @torch.no_grad()
    def init_random(self, seed: int) -> CausalLM:
        """Seeded weights scaled so random logits are peaked enough for stable greedy choices."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() == 2:
                # embeddings: unit scale; projections: 1/sqrt(fan_in) keeps activations O(1)
                std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        kv_pools: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits of the new tokens at ``logits_rows`` (default: each sequence's last new
        token) ``[R, vocab]``; every new token's K/V lands in ``kv_pools`` (one per layer)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(meta.positions, h.dtype)
        rows = meta.last_token_idx if logits_rows is None else logits_rows
        last = len(self.model.layers) - 1
        for i, (layer, pool) in enumerate(zip(self.model.layers, kv_pools)):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, pool, meta)
            if i == last:
                # past the last attention only the sampled rows matter: skip the rest's MLP
                h = h.index_select(0, rows)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.norm(h)).float()

    @torch.no_grad()
    def reference_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Unpaged forward over one whole sequence: logits of every position ``[T, vocab]``."""
        h = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        cos, sin = self._rope(positions, h.dtype)
        for layer in self.model.layers:
            h = h + layer.self_attn.forward_dense(layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.norm(h)).float()
