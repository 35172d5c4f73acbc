"""What msgspec leaves unchecked in a request body, checked once it has decoded (issue 21):

- **UTF-8** (RFC 8259 §8.1): msgspec skips an unknown field's string without looking at its bytes,
  and the proxy forwards the body as is, so bad bytes there reached a worker. Refused with 400.
- **Depth**: at most :data:`MAX_DEPTH` nested arrays and objects. msgspec stops itself at the
  interpreter's recursion limit (a ``RecursionError``, which the decoders answer 400), but that
  limit depends on how deep the caller's stack already is, and what the router passes on (a
  message's content to the tokenizer, re-encoded for a worker's ``/tokenize``, rendered by a
  chat template) recurses again. One documented limit, far below both, makes every body either
  refused here or safe everywhere after. OpenAI bodies nest a few levels; a tool's JSON schema a
  few dozen.
- **Duplicate keys** among the top-level fields the router reads: JSON leaves their meaning open
  (RFC 8259 §4), so the router and a worker behind it could act on different values (route on
  one ``model``, serve another). Refused with 400 naming the key.

The keys and the depth come from one scan in C (``router._native.json_shape``: 1.3 µs for a 25 KB
chat body, where :func:`py_json_shape`, its Python twin for where the extension was not built,
takes 59 µs). On ``/route``'s hot path only what is left once the token array is cut out is
scanned.
"""

from __future__ import annotations

import json
import re
from typing import Any

from router.errors import BadRequest

__all__ = ["MAX_DEPTH", "check_shape", "check_utf8", "json_depth", "py_json_shape", "too_deep"]

#: the deepest nesting of arrays and objects a request body may have
MAX_DEPTH = 128

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")  # (one scan: a pair it uncovers waits for the next)

try:  # the body scanner (router/_native.c)
    from router._native import json_shape as _c_shape
except ImportError:  # pragma: no cover - only where the extension could not be built
    _c_shape = None


def check_utf8(body: bytes) -> None:
    """Raise :class:`BadRequest` unless ``body`` is UTF-8 (an ASCII body is, at memchr speed)."""
    if body.isascii():
        return
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8 (byte {e.start})") from e


def too_deep() -> BadRequest:
    """The error for a body nested past :data:`MAX_DEPTH` (or past msgspec's own limit)."""
    return BadRequest(f"request body is nested more than {MAX_DEPTH} levels deep")


def check_shape(body: bytes, names: frozenset[str]) -> None:
    """Raise :class:`BadRequest` when ``body``, a JSON object msgspec has decoded, nests deeper
    than :data:`MAX_DEPTH` or gives one of ``names`` (the fields the router reads) twice."""
    shape = _c_shape(body) if _c_shape is not None else py_json_shape(body)
    if shape is None:
        return  # (not an object: msgspec said so already)
    keys, depth, escaped = shape
    if depth > MAX_DEPTH:
        raise too_deep()
    if not escaped and len(set(keys)) == len(keys):
        return  # no key twice, none spelled with an escape (``"mod\u0065l"`` is ``model``)
    seen: set[str] = set()
    for raw in keys:
        key = _key_text(raw)
        if key in seen and key in names:
            raise BadRequest(f"request body: duplicate key `{key}`")
        seen.add(key)


def _key_text(raw: bytes) -> str:
    if b"\\" not in raw:
        return raw.decode()
    try:  # (msgspec decoded the key: its escapes are valid)
        return str(json.loads(b'"' + raw + b'"'))
    except ValueError:
        return raw.decode("utf-8", "replace")


def py_json_shape(body: bytes) -> tuple[list[bytes], int, bool] | None:
    """The Python twin of ``router._native.json_shape``: ``(top-level keys as written, depth,
    whether a key holds a backslash)`` of ``body``, a JSON object a decoder accepted (None when
    it is not an object). Keys come back re-encoded, so they match the C scan's wherever a key
    has no escape; the depth is exact up to :data:`MAX_DEPTH`, ``MAX_DEPTH + 1`` past it (the
    keys then left out)."""
    if not body.lstrip(b" \t\r\n").startswith(b"{"):
        return None
    depth = json_depth(body, MAX_DEPTH)
    if depth > MAX_DEPTH:
        return [], depth, False
    top: list[list[tuple[str, Any]]] = []

    def keep(members: list[tuple[str, Any]]) -> None:
        top[:] = [members]  # objects are built inside out: the top level comes last

    try:  # (no deeper than MAX_DEPTH: no RecursionError; valid JSON: msgspec decoded it)
        json.loads(body, object_pairs_hook=keep)
    except ValueError:
        return None
    keys = [json.dumps(k, ensure_ascii=False)[1:-1].encode() for k, _ in top[0]] if top else []
    return keys, depth, any(b"\\" in k for k in keys)


def json_depth(body: bytes, limit: int) -> int:
    """How deep ``body`` (valid JSON) nests arrays and objects, or ``limit + 1`` when deeper than
    ``limit``. Without recursion, in C but for one step per level: the escaped backslashes and
    quotes are dropped (pairing backslashes left to right, as a JSON parser does), so every
    quote left delimits a string; what lies outside the strings, cut to its brackets, loses
    every innermost ``[]`` and ``{}`` pair (and only those) in each pass, so the depth is the
    number of passes that empty it."""
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(body.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    for depth in range(limit + 1):
        if not brackets:
            return depth
        brackets = _INNERMOST.sub(b"", brackets)
    return limit + 1
