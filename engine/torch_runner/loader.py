"""Building the decoder: seeded random weights from a ``tiny-random[:...]`` spec, or a local Hugging
Face directory (``config.json`` + ``*.safetensors``, sharded through
``model.safetensors.index.json`` or not, + optional ``tokenizer.json``). Never touches the hub.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ConfigError, ModelConfig, is_random_spec, parse_model_spec
from .model import CausalLM, rope_inv_freq

__all__ = ["LoadedModel", "LoaderError", "load_model", "resolve_device", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# buffers some checkpoints carry that the model recomputes
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_INDEX = "model.safetensors.index.json"


class LoaderError(RuntimeError):
    """The model could not be built or its weights did not fit it."""


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    tokenizer_path: Path | None  # the directory's tokenizer.json, when there is one
    #: identifies the weights (not the dtype or pool layout): part of the runner's KV fingerprint
    weights_id: str = ""
    eos_token_ids: tuple[int, ...] = ()


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LoaderError("--device cuda requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (fast and exact there), bfloat16 on CUDA (float16 without bf16)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise LoaderError(f"unknown dtype {name!r} (known: auto, {', '.join(_DTYPES)})") from None


def _build(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    # built on the target device with the default init, which the caller overwrites: the meta
    # device would save that init but costs seconds of one-off imports on first use
    with device:
        model = CausalLM(cfg).to(dtype)
    model.inv_freq = rope_inv_freq(cfg).to(device)  # .to(dtype) rounded it; RoPE needs float32
    return model


def _random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    model = _build(cfg, device, dtype)
    # draw on the CPU generator parameter by parameter: same weights on every device
    return model.init_random(cfg.seed)


def _shard_files(root: Path) -> list[Path]:
    index = root / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoaderError(f"bad {index}: {exc!r}") from exc
        files = sorted({root / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise LoaderError(f"{index} names missing shards: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise LoaderError(f"no *.safetensors in {root}")
    return files


def _hf_model(root: Path, device: torch.device, dtype: torch.dtype) -> tuple[CausalLM, ModelConfig]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf_file(root / "config.json")
    state: dict[str, torch.Tensor] = {}
    for path in _shard_files(root):
        try:
            tensors = load_file(str(path), device="cpu")
        except (OSError, SafetensorError) as exc:
            raise LoaderError(f"cannot read {path}: {exc}") from exc
        for name, tensor in tensors.items():
            if not _IGNORED.search(name):
                state[name] = tensor.to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = _build(cfg, device, dtype)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise LoaderError(
            f"checkpoint does not match {cfg.arch}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise LoaderError(
                f"{name}: shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model, cfg


def _eos_ids(root: Path) -> tuple[int, ...]:
    """``eos_token_id`` from generation_config.json, else config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((root / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            return tuple(value)
    return ()


def _dir_weights_id(root: Path) -> str:
    digest = hashlib.blake2b((root / "config.json").read_bytes(), digest_size=8)
    for path in _shard_files(root):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()


def load_model(spec: str, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """``spec``: a preset spec such as ``tiny-random:layers=2,d=256`` or a local HF directory."""
    dev = resolve_device(device)
    try:
        if is_random_spec(spec):
            cfg = parse_model_spec(spec)
            dt = resolve_dtype(dtype if dtype != "auto" or dev.type == "cpu" else cfg.dtype, dev)
            wid = hashlib.blake2b(repr(cfg).encode(), digest_size=8).hexdigest()
            return LoadedModel(_random_model(cfg, dev, dt).eval(), cfg, dev, dt, None, wid)
        root = Path(spec)
        if not (root / "config.json").is_file():
            raise LoaderError(
                f"{spec!r} is neither a model preset nor a directory with config.json"
            )
        dt = resolve_dtype(dtype, dev)
        model, cfg = _hf_model(root, dev, dt)
    except ConfigError as exc:
        raise LoaderError(str(exc)) from exc
    tok = root / "tokenizer.json"
    return LoadedModel(
        model.eval(),
        cfg,
        dev,
        dt,
        tok if tok.is_file() else None,
        _dir_weights_id(root),
        _eos_ids(root),
    )
