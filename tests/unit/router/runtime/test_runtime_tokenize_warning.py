"""The start-up warning for a byte tokenizer in front of engines with their own vocabulary."""

from __future__ import annotations

import json

from router.runtime.tokenize import byte_tokenizer_warning


def models(owner: str) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": "m", "owned_by": owner}]}).encode()


def test_warns_for_vllm_and_sglang_with_byte_tokenizer() -> None:
    msg = byte_tokenizer_warning("byte", "v0", models("vllm"))
    assert msg is not None and "'v0'" in msg and "hf:<dir>" in msg and "worker" in msg
    assert byte_tokenizer_warning("byte", "s0", models("sglang")) is not None


def test_silent_for_the_bundled_engine_other_tokenizers_and_junk() -> None:
    assert byte_tokenizer_warning("byte", "e0", models("kvrouter")) is None
    assert byte_tokenizer_warning("hf:/models/x", "v0", models("vllm")) is None
    assert byte_tokenizer_warning("worker", "v0", models("vllm")) is None
    assert byte_tokenizer_warning("byte", "v0", b"not json") is None
