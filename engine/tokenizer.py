"""Text ↔ token ids for the engine's OpenAI server: the byte tokenizer, or a local tokenizer.json.

Byte tokenizer (the default; the router's built-in ``byte`` tokenizer implements the same
contract; the router's tests check both against each other):

* ``encode(text) = list(text.encode("utf-8"))`` — token id = UTF-8 byte value, no BOS/EOS,
  no special tokens; ``/v1/completions`` with a string prompt uses exactly this.
* ``decode(ids)``: runs of ids < 256 are bytes decoded as UTF-8 with ``errors="replace"``; each id
  >= 256 decodes to U+FFFD.
* chat template, applied to ``messages`` before encoding::

      for m in messages:  "<|" + m.role + "|>\\n" + m.content + "\\n"
      then:               "<|assistant|>\\n"

  ``content`` is a string, or a list of parts whose ``{"type": "text", "text": ...}`` texts (and
  bare strings) are concatenated with no separator; null content is "". Example:
  ``[{"role": "user", "content": "Hi"}]`` → ``"<|user|>\\nHi\\n<|assistant|>\\n"``.

An HF ``tokenizer.json`` (with ``chat_template`` from a ``tokenizer_config.json`` beside it when
present, else the template above) is used when configured or shipped with the runner's model.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ByteTokenizer",
    "ChatTemplateError",
    "Detokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "message_text",
    "render_chat",
]

REPLACEMENT = "\ufffd"


class ChatTemplateError(ValueError):
    """Messages the template cannot render (bad role/content shape, template failure)."""


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):  # lenient, as the router's byte tokenizer is
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise ChatTemplateError("only text content parts are supported")
        return "".join(parts)
    raise ChatTemplateError("message content must be a string or a list of text parts")


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """The fixed chat template (see the module docstring)."""
    out = []
    for m in messages:
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError("every message needs a role")
        out.append(f"<|{role}|>\n{message_text(m.get('content'))}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


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
        return list(text.encode("utf-8"))

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
