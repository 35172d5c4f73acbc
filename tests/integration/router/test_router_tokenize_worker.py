"""``tokenizer: worker``: text requests are tokenized by a registered worker's /tokenize."""

from __future__ import annotations


async def test_worker_tokenizer_routes_text_on_the_workers_token_ids(workers, router, http):
    a = await workers("a")
    r = await router([a], tokenizer="worker")
    text = "hello world, " * 10  # 130 bytes: 8 blocks with the fake worker's byte tokenizer
    a.store(list(text.encode()))
    body = {}
    for _ in range(2000):
        body = (await http.post(r.url + "/route", json={"prompt": text})).json()
        if body["matched_blocks"] == 8:
            break
    assert body["request_blocks"] == 8 and body["matched_blocks"] == 8
    chat = [{"role": "user", "content": text}]
    body = (
        await http.post(r.url + "/route", json={"messages": chat, "model": "fake-model"})
    ).json()
    expected = len(f"<|user|>\n{text}\n<|assistant|>\n".encode()) // 16
    assert body["request_blocks"] == expected
