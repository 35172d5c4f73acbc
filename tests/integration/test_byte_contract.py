"""The router's built-in ``byte`` tokenizer and the bundled engine's default tokenizer agree.

Both import the one contract (``indexer.byte_tokens``; router and engine never import each
other); this test holds their wrappers to it end to end: the same token ids for the same prompt
or chat, or the router would predict cache hits the engine never sees. Where they differ on
purpose (the engine refuses what it cannot serve, the router forwards it), that is checked too.
"""

from __future__ import annotations

import pytest

from engine.tokenizer import ByteTokenizer as EngineBytes
from engine.tokenizer import ChatTemplateError
from router.runtime.tokenize import ByteTokenizer as RouterBytes

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓ 日本"}],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, "b", {"type": "text", "text": "c"}],
        }
    ],
    [{"role": "assistant", "content": None}, {"role": "user", "content": ""}],
]


@pytest.mark.parametrize("messages", CHATS)
async def test_chat_token_ids_agree(messages) -> None:
    engine = EngineBytes()
    router_ids = await RouterBytes().encode_chat(messages)
    assert router_ids == engine.encode(engine.apply_chat_template(messages))


@pytest.mark.parametrize("prompt", ["", "plain ascii", "héllo ✓ 日本\n\t", "x" * 5000])
async def test_prompt_token_ids_agree(prompt: str) -> None:
    assert await RouterBytes().encode(prompt) == EngineBytes().encode(prompt)


async def test_what_the_engine_refuses_the_router_still_places() -> None:
    image = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]
    with pytest.raises(ChatTemplateError):
        EngineBytes().apply_chat_template(image)
    assert bytes(await RouterBytes().encode_chat(image)) == b"<|user|>\na\n<|assistant|>\n"
    with pytest.raises(ChatTemplateError):
        EngineBytes().apply_chat_template([{"content": "no role"}])
