"""Loading a local Hugging Face directory the test writes with ``safetensors`` (HF naming), and the
``tiny-random`` spec. Tolerances (float32): the loaded model's dense logits equal the in-memory
model's (moved to the test device) to ``atol=1e-5`` (same weights, same ops); the runner's paged
prefill matches them to ``atol=1e-4`` (different reduction order; logits here reach ~40), looser in
bfloat16 (``PAGED_TOL``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch_helpers import (
    AUTO_DTYPE,
    DEVICE,
    DTYPES,
    PAGED_TOL,
    assert_greedy_pick,
    dtype_name,
    make_runner,
    prompt,
    step,
)

from engine.torch_runner.config import ConfigError, ModelConfig, parse_model_spec
from engine.torch_runner.loader import LoaderError, load_model
from engine.torch_runner.model import CausalLM, rope_inv_freq

ATOL = 1e-5

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 120,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "eos_token_id": [117, 118],
}
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 130,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "eos_token_id": 129,
}


def _hf_names(cfg: dict) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if cfg["model_type"] == "qwen2":
            names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
    return names


def _write_checkpoint(root, hf_config: dict, seed: int, shards: int) -> CausalLM:
    """An HF-style directory: config.json, safetensors shard(s) (+ index), tokenizer.json."""
    model = CausalLM(ModelConfig.from_hf(hf_config)).init_random(seed).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if hf_config["tie_word_embeddings"]:
        del state["lm_head.weight"]  # tied checkpoints carry the embedding only
    assert set(state) == _hf_names(hf_config)
    state["model.rotary_emb.inv_freq"] = torch.ones(4)  # some exports carry it; must be ignored
    root.mkdir()
    (root / "config.json").write_text(json.dumps(hf_config))
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    names = sorted(state)
    if shards == 1:
        save_file(state, str(root / "model.safetensors"))
        return model
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in names[i::shards]}
        save_file(part, str(root / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fname)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


def _moved(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """``model`` on the test device in ``dtype``, RoPE frequencies kept float32 as the loader
    keeps them (``.to(dtype)`` rounds every buffer)."""
    model = model.to(device=DEVICE, dtype=dtype)
    model.inv_freq = rope_inv_freq(model.config).to(DEVICE)
    return model


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize(
    ("hf_config", "shards"), [(LLAMA_CONFIG, 1), (QWEN2_CONFIG, 3)], ids=["llama", "qwen2-sharded"]
)
def test_hf_directory_reproduces_the_in_memory_model(tmp_path, hf_config, shards, dtype):
    root = tmp_path / "ckpt"
    original = _moved(_write_checkpoint(root, hf_config, seed=11, shards=shards), dtype)
    loaded = load_model(str(root), device=DEVICE, dtype=dtype_name(dtype))
    assert loaded.tokenizer_path == root / "tokenizer.json"
    assert loaded.model.lm_head.weight.device.type == torch.device(DEVICE).type
    ids = torch.tensor(prompt(40, seed=3, vocab=hf_config["vocab_size"]), device=DEVICE)
    torch.testing.assert_close(
        loaded.model.reference_logits(ids), original.reference_logits(ids), atol=ATOL, rtol=0
    )
    if hf_config["tie_word_embeddings"]:
        assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    else:
        assert not torch.equal(loaded.model.lm_head.weight, loaded.model.model.embed_tokens.weight)

    # and through the runner: paged prefill, then greedy picks the dense argmax
    runner = make_runner(str(root), gpu_blocks=20, host_slots=2, dtype=dtype)
    eos = hf_config["eos_token_id"]
    assert runner.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    assert runner.tokenizer_path == str(root / "tokenizer.json")
    ref = original.reference_logits(ids)[-1]
    got = runner.forward_logits([step(1, ids.tolist(), 0, 40, list(range(10)))])[0]
    torch.testing.assert_close(got, ref, **PAGED_TOL[dtype])
    out = runner.execute([step(2, ids.tolist(), 0, 40, list(range(10, 20)))])
    assert_greedy_pick(out.tokens[2], ref, dtype)


def test_loaded_dtype_follows_the_request(tmp_path):
    root = tmp_path / "ckpt"
    _write_checkpoint(root, LLAMA_CONFIG, seed=1, shards=1)
    loaded = load_model(str(root), device=DEVICE, dtype="bfloat16")
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.inv_freq.dtype == torch.float32  # RoPE stays float32 whatever the weights
    # auto: float32 on CPU, bfloat16 on CUDA
    assert load_model(str(root), device=DEVICE).dtype == AUTO_DTYPE


def test_bad_checkpoints_are_refused_with_the_reason(tmp_path):
    root = tmp_path / "ckpt"
    _write_checkpoint(root, LLAMA_CONFIG, seed=1, shards=1)
    state = {"model.embed_tokens.weight": torch.zeros(120, 64)}
    save_file(state, str(root / "model.safetensors"))
    with pytest.raises(LoaderError, match="missing"):
        load_model(str(root), device=DEVICE)
    gpt2 = {k: v for k, v in LLAMA_CONFIG.items() if k != "architectures"} | {"model_type": "gpt2"}
    (root / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(LoaderError, match="unsupported model_type"):
        load_model(str(root), device=DEVICE)
    with pytest.raises(LoaderError, match="neither"):
        load_model(str(tmp_path / "nothing-here"), device=DEVICE)


def test_tiny_random_spec_parsing():
    cfg = parse_model_spec("tiny-random")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 256, 4, 2)
    assert cfg.head_dim == 64 and cfg.intermediate_size % 16 == 0
    cfg = parse_model_spec("tiny-random:layers=3,d=128,heads=8,kv_heads=2,arch=qwen2,seed=9")
    assert (cfg.num_layers, cfg.head_dim, cfg.arch, cfg.seed, cfg.qkv_bias) == (
        3,
        16,
        "qwen2",
        9,
        True,
    )
    big = parse_model_spec("random-0.5b")
    assert 0.4e9 < big.num_parameters() < 0.6e9 and big.dtype == "bfloat16"
    for bad in ("tiny-random:layers", "tiny-random:foo=1", "tiny-random:heads=3", "gpt-9"):
        with pytest.raises(ConfigError):
            parse_model_spec(bad)


def test_same_spec_same_weights():
    spec = "tiny-random:d=32,heads=2,kv_heads=1,seed=4"
    a = load_model(spec, device=DEVICE, dtype="float32").model
    b = load_model(spec, device=DEVICE, dtype="float32").model
    c = load_model(spec.replace("seed=4", "seed=5"), device=DEVICE, dtype="float32").model
    ids = torch.tensor(prompt(12), device=DEVICE)
    assert torch.equal(a.reference_logits(ids), b.reference_logits(ids))
    assert not torch.allclose(a.reference_logits(ids), c.reference_logits(ids))
    # drawn on the CPU generator: the same weights on every device
    on_cpu = load_model(spec, device="cpu", dtype="float32").model.state_dict()
    assert all(torch.equal(v.cpu(), on_cpu[k]) for k, v in a.state_dict().items())
