"""A tiny random Llama for a real vLLM, made offline: ``config.json``, random ``model.safetensors``,
a word-level ``tokenizer.json`` built with the ``tokenizers`` library and a
``tokenizer_config.json`` with a chat template. Nothing is downloaded; a few MB on disk."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
WORDS = [f"w{i}" for i in range(VOCAB - 4)]


def make_tiny_llama(out: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    hidden, inter, layers, heads = 256, 512, 2, 4
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(VOCAB, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rnd(VOCAB, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[p + f"self_attn.{name}.weight"] = rnd(hidden, hidden)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(w, str(out / "model.safetensors"))

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({word: i + 4 for i, word in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "model_max_length": 4096,
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            }
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


def words(n: int, seed: int = 0) -> str:
    """``n`` tokens of text (one word per token id)."""
    return " ".join(WORDS[(seed * 7919 + i * 31) % len(WORDS)] for i in range(n))
