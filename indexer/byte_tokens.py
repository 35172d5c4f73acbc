"""The byte tokenizer: the one tokenization the bundled engine and the router share by contract.

It lives beside the wire contract because both sides must compute it alike, or a text request
the router hashes never matches the blocks the engine reports:

* ``encode(text) = list(text.encode("utf-8"))`` — token id = UTF-8 byte value (0..255), no BOS,
  EOS or special tokens; a string ``prompt`` is exactly this.
* chat, applied to ``messages`` before encoding::

      for m in messages:  "<|" + m.role + "|>\\n" + text(m.content) + "\\n"
      then:               "<|assistant|>\\n"

  ``content`` is a string, or a list of parts whose ``{"type": "text", "text": ...}`` texts (and
  bare strings) are concatenated with no separator; null content is "". Example:
  ``[{"role": "user", "content": "Hi"}]`` → ``"<|user|>\\nHi\\n<|assistant|>\\n"``.

``strict`` is the engine's side: it serves the text, so a message with no role or a non-text
part is an error (:class:`ByteChatError`). The router only places the request and forwards the
body unchanged, so it renders what it can (non-text parts skipped, a missing role empty) and
lets the worker answer. Wherever both accept the messages, both render the same string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["GENERATION_PROMPT", "ByteChatError", "encode", "message_text", "render_chat"]

GENERATION_PROMPT = "<|assistant|>\n"


class ByteChatError(ValueError):
    """Text or messages the byte tokenizer cannot take (the message says which part)."""


def encode(text: str) -> list[int]:
    try:
        return list(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # a lone surrogate (escaped in the JSON)
        raise ByteChatError(f"text is not valid Unicode: {e.reason}") from e


def message_text(content: Any, *, strict: bool = True) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif strict:
                raise ByteChatError("only text content parts are supported")
        return "".join(parts)
    raise ByteChatError("message content must be a string or a list of content parts")


def render_chat(messages: Sequence[Mapping[str, Any]], *, strict: bool = True) -> str:
    out = []
    for m in messages:
        role = m.get("role", "")
        if strict and (not isinstance(role, str) or not role):
            raise ByteChatError("every message needs a role")
        out.append(f"<|{role}|>\n{message_text(m.get('content'), strict=strict)}\n")
    out.append(GENERATION_PROMPT)
    return "".join(out)
