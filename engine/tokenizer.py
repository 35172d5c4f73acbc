"""Text ↔ token ids for the engine's OpenAI server: the byte tokenizer, or a local tokenizer.json.

The byte tokenizer (the default) is the contract the router computes too; it is defined once, in
``indexer.byte_tokens`` (encoding and the chat format), and used here in its strict form: a
message without a role or with a non-text part is refused (:class:`ChatTemplateError`, a 400).

An HF ``tokenizer.json`` (with ``chat_template`` from a ``tokenizer_config.json`` beside it when
present, else the byte chat format) is used when configured or shipped with the runner's model.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from indexer import byte_tokens

__all__ = [
    "ByteTokenizer",
    "ChatTemplateError",
    "Detokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "render_chat",
]

REPLACEMENT = "\ufffd"


class ChatTemplateError(ValueError):
    """Messages the template cannot render (bad role/content shape, template failure)."""


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """The byte chat format (``indexer.byte_tokens``), strict."""
    try:
        return byte_tokens.render_chat(messages)
    except byte_tokens.ByteChatError as e:
        raise ChatTemplateError(str(e)) from e


class Detokenizer(Protocol):
    def feed(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


class Tokenizer(Protocol):
    name: str
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str: ...
    def detokenizer(self) -> Detokenizer: ...


class _ByteDetokenizer:
    """Streaming decode that never splits a multi-byte character across deltas."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            if 0 <= i < 256:
                out.append(self._dec.decode(bytes((i,))))
            else:
                out.append(self._dec.decode(b"", final=True) + REPLACEMENT)
                self._dec.reset()
        return "".join(out)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    name = "byte"
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        try:
            return byte_tokens.encode(text)
        except byte_tokens.ByteChatError as e:
            raise ChatTemplateError(str(e)) from e

    def decode(self, ids: Sequence[int]) -> str:
        d = _ByteDetokenizer()
        return d.feed(ids) + d.flush()

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return render_chat(messages)

    def detokenizer(self) -> Detokenizer:
        return _ByteDetokenizer()


class _HFDetokenizer:
    """Decode the whole output each time and emit the new suffix, holding back a trailing
    replacement character (an incomplete multi-byte sequence)."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._sent = 0

    def feed(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if text.endswith(REPLACEMENT):
            return ""
        delta, self._sent = text[self._sent :], len(text)
        return delta

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        delta, self._sent = text[self._sent :], len(text)
        return delta


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        try:
            self._tok = _Tok.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise ValueError(f"cannot load tokenizer {file}: {exc}") from exc
        self.name = str(file)
        self._template = None
        self._specials: dict[str, str] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        eos: list[int] = []
        if cfg_file.exists():
            cfg = json.loads(cfg_file.read_text())
            for key in ("bos_token", "eos_token"):
                val = cfg.get(key)
                val = val.get("content") if isinstance(val, Mapping) else val
                if isinstance(val, str):
                    self._specials[key] = val
            if isinstance(cfg.get("chat_template"), str):
                import jinja2.sandbox

                env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                    trim_blocks=True, lstrip_blocks=True
                )
                self._template = env.from_string(cfg["chat_template"])
        if "eos_token" in self._specials:
            tid = self._tok.token_to_id(self._specials["eos_token"])
            if tid is not None:
                eos.append(tid)
        self.eos_token_ids = tuple(eos)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self._template is None:
            return render_chat(messages)
        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=True,
                    **self._specials,
                )
            )
        except Exception as exc:  # jinja raises many types, all "the template failed"
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def detokenizer(self) -> Detokenizer:
        return _HFDetokenizer(self)


def load_tokenizer(path: str | None) -> Tokenizer:
    return HFTokenizer(path) if path else ByteTokenizer()
