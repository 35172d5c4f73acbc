"""Model configuration for the torch runner: the decoder's shape, HF ``config.json`` mapping, and
the ``tiny-random[:key=value,...]`` spec that builds seeded random weights without a checkpoint.

Pure Python (no torch import) so the CLI can parse and validate ``--model`` cheaply.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PRESETS",
    "ConfigError",
    "ModelConfig",
    "parse_model_spec",
]

ARCH_LLAMA = "llama"
ARCH_QWEN2 = "qwen2"
_HF_ARCH = {ARCH_LLAMA: "LlamaForCausalLM", ARCH_QWEN2: "Qwen2ForCausalLM"}


class ConfigError(ValueError):
    """A model spec or ``config.json`` the runner cannot build a decoder from."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (Llama and Qwen2 differ only in q/k/v biases here)."""

    arch: str = ARCH_LLAMA
    vocab_size: int = 256
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 688
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF ``rope_scaling`` dict (llama3 / linear) or None
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # preferred dtype name for this model ("auto" lets the runner pick per device)
    dtype: str = "auto"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in _HF_ARCH:
            raise ConfigError(f"unsupported architecture {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError("head_dim must be a positive even number (RoPE rotates pairs)")

    @property
    def qkv_bias(self) -> bool:
        return self.arch == ARCH_QWEN2 or self.attention_bias

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size

    def num_parameters(self) -> int:
        d, h = self.hidden_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + d

    # -- HF config.json ---------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama or Qwen2)."""
        model_type = str(cfg.get("model_type", "")).lower()
        archs = [str(a) for a in cfg.get("architectures") or []]
        if model_type == ARCH_QWEN2 or "Qwen2ForCausalLM" in archs:
            arch = ARCH_QWEN2
        elif model_type in ("llama", "mistral") or any(
            a in ("LlamaForCausalLM", "MistralForCausalLM") for a in archs
        ):
            arch = ARCH_LLAMA
        else:
            raise ConfigError(f"unsupported model_type {model_type!r} / architectures {archs!r}")
        if cfg.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            scaling = cfg.get("rope_scaling")
            if scaling is not None:
                kind = scaling.get("rope_type", scaling.get("type"))
                if kind not in ("llama3", "linear", "default"):
                    raise ConfigError(f"unsupported rope_scaling type {kind!r}")
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "auto")
            return cls(
                arch=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                dtype=dtype,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"bad config.json: {exc!r}") from exc

    @classmethod
    def from_hf_file(cls, path: str | Path) -> ModelConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: not a JSON object")
        return cls.from_hf(data)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` a Hugging Face checkpoint of this model would carry."""
        out: dict[str, Any] = {
            "architectures": [_HF_ARCH[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32" if self.dtype == "auto" else self.dtype,
        }
        if self.arch == ARCH_LLAMA:
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        return out


# -- tiny-random spec -----------------------------------------------------------------------------

#: Named shapes for ``--model NAME[:overrides]``: random weights, seeded.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-random": {"layers": 2, "d": 256, "heads": 4, "kv_heads": 2, "vocab": 256},
    # about 0.5B parameters (Qwen2-0.5B's shape with a byte vocabulary), for GPU benchmarks
    "random-0.5b": {
        "layers": 24,
        "d": 896,
        "heads": 14,
        "kv_heads": 2,
        "ffn": 4864,
        "vocab": 151936,
        "arch": "qwen2",
        "dtype": "bfloat16",
        "theta": 1000000.0,
        "tie": True,
    },
}

_ALIASES = {
    "layers": "num_layers",
    "d": "hidden_size",
    "hidden": "hidden_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
    "arch": "arch",
    "dtype": "dtype",
    "seed": "seed",
    "theta": "rope_theta",
    "eps": "rms_norm_eps",
    "tie": "tie_word_embeddings",
    "max_pos": "max_position_embeddings",
}


def is_random_spec(spec: str) -> bool:
    return spec.split(":", 1)[0] in PRESETS


def parse_model_spec(spec: str) -> ModelConfig:
    """Parse ``tiny-random[:layers=2,d=256,heads=4,kv_heads=2,...]`` (or another preset name).

    Unspecified ``head_dim`` is ``d // heads``; unspecified ``ffn`` is Llama's rounding of 8d/3
    up to a multiple of 16.
    """
    name, _, rest = spec.partition(":")
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    raw: dict[str, Any] = dict(PRESETS[name])
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _ALIASES:
            raise ConfigError(f"bad model spec item {item!r} (keys: {', '.join(_ALIASES)})")
        raw[key] = value.strip()
    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        target = _ALIASES[key]
        kind = str(fields[target])
        try:
            if kind == "int":
                kwargs[target] = int(value)
            elif kind == "float":
                kwargs[target] = float(value)
            elif kind == "bool":
                kwargs[target] = str(value).lower() in ("1", "true", "yes")
            else:
                kwargs[target] = str(value)
        except ValueError as exc:
            raise ConfigError(f"bad value for {key}: {value!r}") from exc
    d, heads = kwargs["hidden_size"], kwargs["num_heads"]
    if heads <= 0 or d <= 0:
        raise ConfigError("d and heads must be positive")
    kwargs.setdefault("head_dim", d // heads)
    if "intermediate_size" not in kwargs:
        kwargs["intermediate_size"] = -(-(8 * d // 3) // 16) * 16
    return ModelConfig(**kwargs)
