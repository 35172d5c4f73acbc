"""Tokenizers: the byte tokenizer contract shared with the router, streaming decode, and a local
HF tokenizer.json with its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.protocol import StopChecker
from engine.tokenizer import (
    ByteTokenizer,
    ChatTemplateError,
    HFTokenizer,
    load_tokenizer,
    render_chat,
)


def test_byte_tokenizer_contract() -> None:
    tok = ByteTokenizer()
    assert tok.encode("hé!") == [104, 0xC3, 0xA9, 33]
    assert tok.decode([104, 0xC3, 0xA9, 33]) == "hé!"
    assert tok.decode([104, 300, 105]) == "h\ufffdi"  # ids >= 256: U+FFFD
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated character
    assert tok.eos_token_ids == ()


def test_chat_template_is_the_documented_string() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": None},
    ]
    assert render_chat(msgs) == (
        "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n\n<|assistant|>\n"
    )
    assert ByteTokenizer().apply_chat_template(msgs) == render_chat(msgs)
    with pytest.raises(ChatTemplateError):
        render_chat([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ChatTemplateError):
        render_chat([{"content": "no role"}])


def test_streaming_decode_never_splits_a_character() -> None:
    d = ByteTokenizer().detokenizer()
    ids = list("aé€😀".encode())
    deltas = [d.feed([i]) for i in ids]
    assert "".join(deltas) + d.flush() == "aé€😀"
    assert all("\ufffd" not in x for x in deltas)


def test_stop_checker_holds_back_a_possible_stop_prefix() -> None:
    s = StopChecker(["END"])
    assert s.feed("abcE") == "ab"  # len("END") - 1 characters are held back
    assert s.feed("N") == "c"
    assert s.feed("Dxyz") == "" and s.stopped and s.text == "abc"
    assert s.feed("more") == "" and s.flush() == ""


def _hf_dir(tmp: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "<": 4, ">": 5, "user": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}{{ eos_token }}"
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "chat_template": template})
    )
    return tmp


def test_hf_tokenizer_json_with_its_chat_template(tmp_path: Path) -> None:
    tok = load_tokenizer(str(_hf_dir(tmp_path)))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_token_ids == (1,)
    assert tok.decode([2, 3]) == "hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "<user> hello </s>"
    d = tok.detokenizer()
    assert d.feed([2]) + d.feed([3]) + d.flush() == "hello world"
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        HFTokenizer(tmp_path / "missing.json")
