"""Text → token ids for routing, when a request carries text instead of ``token_ids``.

- ``byte`` (default): token id = UTF-8 byte value (0..255), no special tokens — the bundled
  engine's default tokenizer, by the contract both import (``indexer.byte_tokens``); chat
  messages are rendered in its chat format first.
- ``hf:<dir>``: a local Hugging Face ``tokenizer.json`` (``tokenizers`` package); chat messages
  go through the ``chat_template`` of ``<dir>/tokenizer_config.json`` rendered with jinja2 in a
  sandbox, like ``transformers.apply_chat_template(..., add_generation_prompt=True)``.
- ``worker``: the worker's own ``POST /tokenize`` (vLLM's shape: ``{"model", "prompt"}`` or
  ``{"model", "messages"}`` → ``{"tokens": [...]}``); only registered worker URLs are called.

Work that may take more than a few milliseconds runs in a thread (``asyncio.to_thread``) so
the event loop — which owns the index — keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from indexer import byte_tokens
from router.errors import ConfigError, NoHealthyWorker, TokenizeError
from router.fleet.upstream import UpstreamError, UpstreamPool

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "WorkerTokenizer",
    "byte_tokenizer_warning",
    "make_tokenizer",
    "message_text",
    "render_byte_chat",
]

# Byte tokenization is a memcpy; only huge prompts leave the loop. An HF tokenizer spends about
# 1 µs per character, so a few thousand characters is already a few milliseconds.
_BYTE_OFFLOOP_CHARS = 1 << 20
Picker = Callable[[str | None], tuple[str, str]]
_HF_OFFLOOP_CHARS = 2048


def message_text(content: Any) -> str:
    """OpenAI message content: a string, or a list of parts of which the text parts count."""
    try:
        return byte_tokens.message_text(content, strict=False)
    except byte_tokens.ByteChatError as e:
        raise TokenizeError(f"messages[].content: {e}") from e


def render_byte_chat(messages: Sequence[Any]) -> str:
    """The byte chat format (``indexer.byte_tokens``), lenient: the router only places the
    request; the worker judges what it cannot render."""
    try:
        return byte_tokens.render_chat(messages, strict=False)
    except byte_tokens.ByteChatError as e:
        raise TokenizeError(f"messages: {e}") from e


class Tokenizer(Protocol):
    name: str

    async def encode(self, prompt: str, model: str | None = None) -> list[int]: ...

    async def encode_chat(
        self, messages: list[dict[str, Any]], model: str | None = None
    ) -> list[int]: ...


class ByteTokenizer:
    name = "byte"

    @staticmethod
    def encode_sync(text: str) -> list[int]:
        try:
            return byte_tokens.encode(text)
        except byte_tokens.ByteChatError as e:  # a lone surrogate escaped in the JSON
            raise TokenizeError(f"prompt: {e}") from e

    async def encode(self, prompt: str, model: str | None = None) -> list[int]:
        if len(prompt) > _BYTE_OFFLOOP_CHARS:
            return await asyncio.to_thread(self.encode_sync, prompt)
        return self.encode_sync(prompt)

    async def encode_chat(
        self, messages: list[dict[str, Any]], model: str | None = None
    ) -> list[int]:
        return await self.encode(render_byte_chat(messages))


def _special(value: Any) -> str:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class HFTokenizer:
    def __init__(self, directory: str | Path) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as _HF

        d = Path(directory)
        self.name = f"hf:{d}"
        try:
            self._tok = _HF.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise ConfigError(
                f"invalid config: tokenizer: cannot load {d / 'tokenizer.json'}: {e}; "
                "hf:<dir> (--tokenizer) takes the directory of the workers' model that holds "
                "its tokenizer.json (a Hugging Face snapshot), or use 'worker' (their /tokenize)"
            ) from e
        cfg: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"invalid config: tokenizer: cannot read {cfg_path}: {e}") from e
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self._bos = _special(cfg.get("bos_token"))
        self._eos = _special(cfg.get("eos_token"))
        self._template = None
        self._template_error = TemplateError
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            try:
                self._template = env.from_string(template)
            except TemplateError as e:
                raise ConfigError(f"invalid config: tokenizer: bad chat_template: {e}") from e

    def encode_sync(self, prompt: str, *, special: bool = True) -> list[int]:
        return list(self._tok.encode(prompt, add_special_tokens=special).ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self._template is None:  # as the bundled engine does: the byte chat format
            return render_byte_chat(messages)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except self._template_error as e:
            raise TokenizeError(f"chat template failed on these messages: {e}") from e

    def _chat_sync(self, messages: list[dict[str, Any]]) -> list[int]:
        # the template already placed the special tokens it wants
        return self.encode_sync(self.render_chat(messages), special=False)

    async def encode(self, prompt: str, model: str | None = None) -> list[int]:
        if len(prompt) > _HF_OFFLOOP_CHARS:
            return await asyncio.to_thread(self.encode_sync, prompt)
        return self.encode_sync(prompt)

    async def encode_chat(
        self, messages: list[dict[str, Any]], model: str | None = None
    ) -> list[int]:
        size = sum(len(message_text(m.get("content"))) for m in messages)
        if size > _HF_OFFLOOP_CHARS:
            return await asyncio.to_thread(self._chat_sync, messages)
        return self._chat_sync(messages)


def _raise_template_error(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


class _TokenizeReply(msgspec.Struct):
    tokens: list[int]


_decode_reply = msgspec.json.Decoder(_TokenizeReply).decode


class WorkerTokenizer:
    """Asks a registered worker: ``pick(model)`` returns ``(base_url, model name to send)`` of a
    healthy worker serving ``model`` (raises :class:`NoHealthyWorker` when there is none)."""

    name = "worker"

    def __init__(self, client: UpstreamPool, pick: Picker) -> None:
        self._client = client
        self._pick = pick

    async def _call(self, body: dict[str, Any], model: str | None) -> list[int]:
        url, name = self._pick(model)
        if name:
            body["model"] = name
        payload = msgspec.json.encode(body)
        try:
            r = await self._client.request(
                url, "POST", "/tokenize", [("Content-Type", "application/json")], payload
            )
            try:
                status, content = r.status_code, await r.read()
            finally:
                await r.aclose()
        except UpstreamError as e:
            raise NoHealthyWorker(f"worker tokenizer unreachable: {e}") from e
        if status != 200:
            text = content[:200].decode("utf-8", "replace")
            raise TokenizeError(f"worker /tokenize answered {status}: {text}")
        try:
            return _decode_reply(content).tokens
        except msgspec.DecodeError as e:
            raise TokenizeError(f"worker /tokenize answered an unexpected body: {e}") from e

    async def encode(self, prompt: str, model: str | None = None) -> list[int]:
        return await self._call({"prompt": prompt}, model)

    async def encode_chat(
        self, messages: list[dict[str, Any]], model: str | None = None
    ) -> list[int]:
        return await self._call({"messages": messages, "add_generation_prompt": True}, model)


#: ``owned_by`` of ``/v1/models`` for engines with their own vocabulary: byte token ids (0..255)
#: never equal theirs, so the byte tokenizer makes every text request miss their cache.
_OWN_VOCAB_ENGINES = frozenset({"vllm", "sglang"})


class _Model(msgspec.Struct):
    owned_by: str = ""


class _Models(msgspec.Struct):
    data: list[_Model] = []


_decode_models = msgspec.json.Decoder(_Models).decode


def byte_tokenizer_warning(spec: str, worker_id: str, models_body: bytes) -> str | None:
    """The warning for a worker whose ``/v1/models`` says it is vLLM or SGLang while the router
    tokenizes text as bytes (text requests could never match its blocks); None when fine."""
    if spec != "byte":
        return None
    try:
        owners = {m.owned_by.lower() for m in _decode_models(models_body).data}
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    engines = sorted(owners & _OWN_VOCAB_ENGINES)
    if not engines:
        return None
    return (
        f"worker {worker_id!r} is {engines[0]}, but tokenizer is 'byte': text requests (prompt, "
        "messages) can never match its cache. Set tokenizer to 'hf:<dir>' (its tokenizer.json) "
        "or 'worker' (its /tokenize), or send token_ids"
    )


def make_tokenizer(
    spec: str,
    *,
    client: UpstreamPool | None = None,
    pick: Picker | None = None,
) -> Tokenizer:
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    if spec == "worker":
        if client is None or pick is None:
            raise ConfigError("invalid config: tokenizer: 'worker' needs the router's HTTP client")
        return WorkerTokenizer(client, pick)
    raise ConfigError(f"invalid config: tokenizer: unknown tokenizer {spec!r}")
