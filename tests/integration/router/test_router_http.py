"""The router's listener (uvicorn with ``router.edge.server``'s config), checked on a raw socket with a
real HTTP parser (h11) on the client side: ``/route`` answers equal the placement's, pipelined requests keep their
order, ``Connection: close`` and HTTP/1.0 close, odd bodies get the documented 4xx."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import h11
import httpx
from router_fakeworker import ServerHandle, wait_for

from router.edge.app import create_app
from router.settings import load_settings

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # 360 bytes = 22 full blocks


class RawClient:
    """One keep-alive connection; requests are written as given (pipelining allowed) and each
    response is parsed by a fresh h11 client state machine, fed what the previous one left."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buffer = b""

    @classmethod
    async def open(cls, url: str) -> RawClient:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def send_raw(self, *requests: bytes) -> None:
        self.writer.write(b"".join(requests))
        await self.writer.drain()

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        conn = h11.Connection(h11.CLIENT)
        if self.buffer:  # (b"" would mean end of stream to h11)
            conn.receive_data(self.buffer)
        status, headers, body = 0, {}, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await asyncio.wait_for(self.reader.read(1 << 16), 20))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.buffer = conn.trailing_data[0]
                return status, headers, body
            else:
                raise AssertionError(f"unexpected {event!r}")

    async def closed_by_server(self) -> bool:
        return self.buffer == b"" and await asyncio.wait_for(self.reader.read(1), 20) == b""

    def close(self) -> None:
        self.writer.close()


def post(path: str, body: Any, *, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        b"POST %s HTTP/%s\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n%s" % (path.encode(), version, len(data), extra, data)
    )


def get(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path.encode()


def without_route_id(answer: bytes) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(answer)
    out.pop("route_id", None)
    return out


async def test_direct_route_answers_like_the_app(workers, router, http):
    a = await workers("a")
    b = await workers("b")
    b.store(list(PROMPT.encode()))
    r = await router([a, b])
    await wait_for(lambda: r.matched(list(PROMPT.encode()), "b") == 22, 10, "events")
    by_tokens = await http.post(r.url + "/route", json={"token_ids": list(PROMPT.encode())})
    by_prompt = await http.post(r.url + "/route", json={"prompt": PROMPT})  # through the app
    assert by_tokens.status_code == by_prompt.status_code == 200
    assert by_tokens.headers["content-type"] == "application/json"
    assert json.loads(by_tokens.content) == json.loads(by_prompt.content)
    assert json.loads(by_tokens.content)["worker_id"] == "b"
    # the token array anywhere among the fields, and compact or spaced, parses the same
    for body in (
        b'{"model": null, "token_ids": %s, "account": false}'
        % json.dumps(list(PROMPT.encode())).encode(),
        b'{"token_ids":%s}' % json.dumps(list(PROMPT.encode()), separators=(",", ":")).encode(),
    ):
        resp = await http.post(r.url + "/route", content=body)
        assert json.loads(resp.content) == json.loads(by_tokens.content)


async def test_pipelined_requests_are_answered_in_order(workers, router):
    a = await workers("a")
    r = await router([a])
    c = await RawClient.open(r.url)
    try:
        await c.send_raw(
            post("/route", {"token_ids": [1] * 40}),
            get("/health"),
            post("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 2}),
            post("/route", {"prompt": "hello"}),  # through the app, behind the proxied one
            post("/route", {"token_ids": [2] * 40}),
        )
        s1, _, b1 = await c.response()
        s2, _, b2 = await c.response()
        s3, h3, b3 = await c.response()
        s4, _, b4 = await c.response()
        s5, _, b5 = await c.response()
    finally:
        c.close()
    assert (s1, s2, s3, s4, s5) == (200, 200, 200, 200, 200)
    assert json.loads(b1)["request_blocks"] == 2
    assert json.loads(b2)["status"] == "ok"
    assert h3["x-kvrouter-worker"] == "a" and json.loads(b3)["choices"][0]["text"].startswith("tok")
    assert json.loads(b4)["request_blocks"] == 0
    assert json.loads(b5)["request_blocks"] == 2
    assert len(a.requests) == 1
    # a proxied request answered directly first: the rest queue behind it
    c = await RawClient.open(r.url)
    try:
        await c.send_raw(
            post("/v1/completions", {"model": "fake-model", "prompt": "hi", "stream": True}),
            get("/health"),
            post("/route", {"token_ids": [3] * 48}),
        )
        answers = [await c.response() for _ in range(3)]
    finally:
        c.close()
    assert [s for s, _, _ in answers] == [200, 200, 200]
    assert answers[0][1]["transfer-encoding"] == "chunked"
    assert answers[0][2].rstrip().endswith(b"data: [DONE]")
    assert json.loads(answers[1][2])["status"] == "ok"
    assert json.loads(answers[2][2])["request_blocks"] == 3
    # two proxied requests in one write: each forwards its own headers, not the next one's
    c = await RawClient.open(r.url)
    try:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 1}
        await c.send_raw(
            post("/v1/completions", body, extra=b"Authorization: Bearer first\r\n"),
            post("/v1/completions", body, extra=b"Authorization: Bearer second\r\n"),
        )
        assert [(await c.response())[0] for _ in range(2)] == [200, 200]
    finally:
        c.close()
    assert [h.get("authorization") for h in a.request_headers[-2:]] == [
        "Bearer first",
        "Bearer second",
    ]


async def test_connection_close_and_http10_close_after_the_answer(workers, router):
    a = await workers("a")
    r = await router([a])
    for extra, version in ((b"Connection: close\r\n", b"1.1"), (b"", b"1.0")):
        for path, body in (
            ("/route", {"token_ids": [1] * 20}),
            ("/v1/completions", {"model": "fake-model", "prompt": "x"}),
        ):
            c = await RawClient.open(r.url)
            try:
                await c.send_raw(post(path, body, extra=extra, version=version))
                status, headers, _ = await c.response()
                assert status == 200, (path, version)
                if version == b"1.1":
                    assert headers.get("connection") == "close"
                assert await c.closed_by_server(), (path, version)
            finally:
                c.close()


async def test_odd_route_bodies(workers, router, http):
    a = await workers("a")
    r = await router([a])

    async def err(body: bytes, status: int) -> str:
        resp = await http.post(r.url + "/route", content=body)
        assert resp.status_code == status, (body, resp.text)
        return str(resp.json()["error"]["message"])

    assert "token_ids" in await err(b'{"token_ids": [[1, 2], [3]]}', 422)
    assert "JSON" in await err(b'{"token_ids": [1,,2]}', 400)
    assert "JSON" in await err(b'{"token_ids": [1, 2], "model": }', 400)
    assert "token_ids[0]" in await err(b'{"token_ids": [1.5]}', 422)
    assert "token_ids" in await err(b'{"token_ids": ["a]"]}', 422)
    # only a top-level token_ids counts: a nested one is just an unknown field's content
    assert "required" in await err(b'{"x": {"token_ids": [1, 2, 3]}}', 400)
    ok = await http.post(
        r.url + "/route",
        content=b'{"x": {"token_ids": [9]}, "token_ids": [%s]}' % b",".join([b"5"] * 32),
    )
    assert ok.status_code == 200 and ok.json()["request_blocks"] == 2
    # a key with an escaped quote is not token_ids
    assert "required" in await err(b'{"token_ids\\"": [1, 2]}', 400)


async def test_the_hot_paths_and_the_app_answer_alike(workers, router, http, monkeypatch, caplog):
    """``/route`` and the OpenAI endpoints skip FastAPI (router.edge): a wrong method, and an
    error nobody expected, get the same OpenAI-shaped answers and headers as through the app."""
    a = await workers("a")
    r = await router([a])
    for path in ("/route", "/v1/completions", "/v1/chat/completions"):
        resp = await http.get(r.url + path)
        assert resp.status_code == 405 and resp.headers["allow"] == "POST", path
        assert resp.json()["error"]["type"] == "invalid_request_error", path
        assert resp.headers["x-request-id"], path  # the access log wraps the hot paths too
    missing = await http.get(r.url + "/nope")  # through FastAPI
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert missing.headers["x-request-id"]

    def broken(*args: Any, **kwargs: Any) -> Any:  # a bug no real peer can provoke: a seam
        raise RuntimeError("placement bug")

    monkeypatch.setattr(r.state.placer, "place", broken)
    body = {"prompt": "hi", "max_tokens": 1}
    for path, payload in (("/route", {"token_ids": [1, 2, 3]}), ("/v1/completions", body)):
        resp = await http.post(r.url + path, json=payload)
        assert resp.status_code == 500, path
        assert resp.json()["error"] == {
            "message": "internal router error",
            "type": "internal_error",
            "param": None,
            "code": None,
        }
    assert sum("placement bug" in (rec.exc_text or "") for rec in caplog.records) == 2
    assert not a.requests
    monkeypatch.undo()
    ok = await http.post(r.url + "/route", json={"token_ids": [1, 2, 3]})
    assert ok.status_code == 200  # the server serves on


async def test_streamed_body_over_the_limit_gets_413_then_close(workers, router):
    a = await workers("a")
    r = await router([a], proxy={"max_body_bytes": 1024})
    async with httpx.AsyncClient(timeout=20, trust_env=False) as c:

        async def chunks():  # no Content-Length: the limit is found while reading
            for _ in range(40):
                yield b"x" * 100

        for path in ("/route", "/v1/completions"):
            resp = await c.post(r.url + path, content=chunks())
            assert resp.status_code == 413, path
            assert "1024" in resp.json()["error"]["message"]
    assert not a.requests


async def test_keep_alive_closes_only_after_a_whole_idle_timeout():
    """One keep-alive timer per connection, re-armed lazily: requests spaced under the timeout
    keep the connection open well past it (direct and app-served answers alike); once idle for
    the timeout, the server closes it."""
    app = create_app(load_settings(environ={}, overrides={"workers": []}))
    server = await ServerHandle(app, router=True, timeout_keep_alive=0.4).start()
    try:
        c = await RawClient.open(server.url)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(8):  # 8 x 0.15 s: three timeouts' worth, never 0.4 s idle
            await c.send_raw(post("/route", {"token_ids": [1, 2, 3]}) if i % 2 else get("/health"))
            status, _, _ = await c.response()
            assert status == (503 if i % 2 else 200)  # no worker for /route: still an answer
            await asyncio.sleep(0.15)
        assert loop.time() - start > 1.0
        idle_from = loop.time()
        assert await c.closed_by_server()
        assert loop.time() - idle_from >= 0.4 - 0.15 - 0.05  # (0.15 s of it already idle)
        c.close()
    finally:
        await server.stop()


async def test_a_head_that_never_finishes_is_closed_at_the_head_deadline():
    """``server.head_timeout_s`` (uvicorn has no head read timeout): a client trickling one
    header byte every 0.1 s and one that sends nothing are closed at the deadline; a request in
    progress (its body still coming) is not: it gets its own body timeout's 408."""
    overrides = {"workers": [], "server": {"head_timeout_s": 0.8, "body_timeout_s": 2.5}}
    app = create_app(load_settings(environ={}, overrides=overrides))
    server = await ServerHandle(app, router=True).start()
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        trickle_r, trickle_w = await asyncio.open_connection("127.0.0.1", server.port)
        silent_r, silent_w = await asyncio.open_connection("127.0.0.1", server.port)
        body_r, body_w = await asyncio.open_connection("127.0.0.1", server.port)
        body_w.write(b'POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"tok')
        trickle_w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        # a WebSocket upgrade is answered as plain HTTP: no connection leaves the deadline's view
        ws_r, ws_w = await asyncio.open_connection("127.0.0.1", server.port)
        ws_w.write(
            b"GET /health HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        assert (await asyncio.wait_for(ws_r.readuntil(b"\r\n"), 10)).startswith(b"HTTP/1.1 200")

        async def drip() -> None:
            with contextlib.suppress(ConnectionError):
                while True:
                    trickle_w.write(b"X")
                    await trickle_w.drain()
                    await asyncio.sleep(0.1)  # the hostile client's pace, not a wait for state

        async def closed(r: asyncio.StreamReader) -> bytes:
            # the server's close reaches a client still writing (the dripper) as a reset
            try:
                return await asyncio.wait_for(r.read(), 10)
            except ConnectionResetError:
                return b""

        dripper = asyncio.create_task(drip())
        assert await closed(trickle_r) == b""
        assert await asyncio.wait_for(silent_r.read(), 10) == b""
        assert loop.time() - start >= 0.8
        dripper.cancel()
        head = await asyncio.wait_for(body_r.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 408 "), head
        await asyncio.wait_for(ws_r.read(), 10)  # its idle keep-alive is closed too
        for w in (trickle_w, silent_w, body_w, ws_w):
            w.close()
        async with httpx.AsyncClient(trust_env=False) as http:
            text = (await http.get(server.url + "/metrics")).text
        assert 'kvrouter_http_connections_closed_total{reason="head_timeout"} 3.0' in text
    finally:
        await server.stop()


async def test_a_busy_keep_alive_connection_outlives_the_head_deadline():
    """Requests every 20 ms on one connection for three head deadlines: the deadline's 100 ms
    tick mostly finds the connection between two requests, but each time with a newer request
    cycle, so it is never closed."""
    overrides = {"workers": [], "server": {"head_timeout_s": 0.5}}
    server = await ServerHandle(
        create_app(load_settings(environ={}, overrides=overrides)), router=True
    ).start()
    try:
        c = await RawClient.open(server.url)
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < 1.6:
            await c.send_raw(get("/health"))
            status, _, _ = await c.response()
            assert status == 200
            await asyncio.sleep(0.02)  # the client's pace between requests
        c.close()
        async with httpx.AsyncClient(trust_env=False) as http:
            text = (await http.get(server.url + "/metrics")).text
        assert 'connections_closed_total{reason="head_timeout"}' not in text
    finally:
        await server.stop()
