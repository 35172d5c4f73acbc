"""Tokenizers: the byte contract shared with the bundled engine, and a local HF tokenizer.json
with a jinja2 chat template (built here with the ``tokenizers`` package)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from router.errors import ConfigError, TokenizeError
from router.runtime.tokenize import ByteTokenizer, HFTokenizer, make_tokenizer, render_byte_chat


async def test_byte_tokenizer_is_utf8_bytes():
    t = ByteTokenizer()
    assert await t.encode("hé!") == [104, 195, 169, 33]
    with pytest.raises(TokenizeError):
        await t.encode("\ud800")
    big = "x" * (1 << 21)  # off the loop, same answer
    assert await t.encode(big) == [120] * (1 << 21)


async def test_byte_chat_matches_the_engine_contract():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_byte_chat(msgs) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert render_byte_chat(parts) == "<|user|>\nab\n<|assistant|>\n"
    assert render_byte_chat([{"role": "user", "content": None}]) == "<|user|>\n\n<|assistant|>\n"
    ids = await ByteTokenizer().encode_chat(msgs)
    assert bytes(ids).decode() == render_byte_chat(msgs)


def _hf_dir(tmp_path, template: str | None):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
    tok.train_from_iterator(
        ["hello world", "user assistant system says hi", "<", ">", "|"], trainer
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


async def test_hf_tokenizer_and_chat_template(tmp_path):
    d = _hf_dir(
        tmp_path,
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} says {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant says{% endif %}",
    )
    t = make_tokenizer(f"hf:{d}")
    assert isinstance(t, HFTokenizer)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert await t.encode("hello world") == raw.encode("hello world").ids
    assert await t.encode("hello " * 2000) == raw.encode("hello " * 2000).ids  # off the loop
    msgs = [{"role": "user", "content": "hello"}]
    assert t.render_chat(msgs) == "<s>user says hello assistant says"
    assert (
        await t.encode_chat(msgs)
        == raw.encode("<s>user says hello assistant says", add_special_tokens=False).ids
    )


async def test_hf_template_errors_and_fallback(tmp_path):
    d = _hf_dir(tmp_path, "{{ raise_exception('no system role') }}")
    with pytest.raises(TokenizeError, match="no system role"):
        await HFTokenizer(d).encode_chat([{"role": "system", "content": "x"}])
    plain = _hf_dir(tmp_path, None)
    assert HFTokenizer(plain).render_chat([{"role": "user", "content": "hi"}]) == (
        "<|user|>\nhi\n<|assistant|>\n"
    )
    with pytest.raises(ConfigError, match="tokenizer"):
        make_tokenizer(f"hf:{tmp_path / 'missing'}")
    (tmp_path / "bad").mkdir()
    with pytest.raises(ConfigError, match="chat_template"):
        HFTokenizer(_hf_dir(tmp_path / "bad", "{% for %}"))
    with pytest.raises(ConfigError):
        make_tokenizer("worker")
