"""The byte tokenizer contract (indexer/byte_tokens.py): encoding, the chat format, strictness."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer.byte_tokens import ByteChatError, encode, message_text, render_chat


@given(st.text())
def test_encode_is_the_utf8_bytes(text: str) -> None:
    try:
        want = list(text.encode("utf-8"))
    except UnicodeEncodeError:
        with pytest.raises(ByteChatError, match="not valid Unicode"):
            encode(text)
        return
    assert encode(text) == want and all(0 <= t < 256 for t in want)


def test_chat_format_by_hand() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(msgs) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert render_chat([]) == "<|assistant|>\n"
    parts = [{"type": "text", "text": "a"}, "b", {"type": "text", "text": "c"}]
    assert message_text(parts) == "abc" and message_text(None) == ""


def test_strict_refuses_what_lenient_skips() -> None:
    image = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ByteChatError, match="text content parts"):
        message_text(image)
    assert message_text(image, strict=False) == "a"
    with pytest.raises(ByteChatError, match="role"):
        render_chat([{"content": "x"}])
    assert render_chat([{"content": "x"}], strict=False) == "<||>\nx\n<|assistant|>\n"
    for strict in (True, False):  # a content of the wrong type is an error either way
        with pytest.raises(ByteChatError, match="content"):
            message_text(5, strict=strict)
