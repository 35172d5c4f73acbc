"""Request framing and targets on the router's listener (issue 21), over raw sockets, with both
HTTP parsers the router supports (``server.http``: h11, the default, and httptools):

- a request with both ``Content-Length`` and ``Transfer-Encoding`` is answered 400 and the
  connection closed after that answer (RFC 9112 §6.1): a request hidden in its body is never
  answered, on every path;
- an absolute-form target (``POST http://host/route``, RFC 9112 §3.2.2) is served as its path,
  and the authority in it is never connected to;
- an ``Upgrade: websocket`` request is answered as plain HTTP without uvicorn's warnings.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import h11
import pytest

PARSERS = pytest.mark.parametrize("parser", ["h11", "httptools"])
HIDDEN = b"GET /workers HTTP/1.1\r\nHost: x\r\n\r\n"


async def exchange(port: int, data: bytes) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
    """Send ``data`` on a fresh connection; read until the server closes it (or 10 s pass).
    Returns the responses parsed from what came back, and whether the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got, closed = b"", False
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 16), 10):
            got += chunk
        closed = True
    except asyncio.TimeoutError:
        pass
    finally:
        writer.close()
    return list(_responses(got)), closed


def _responses(data: bytes) -> Iterator[tuple[int, dict[str, str], bytes]]:
    while data:
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(data)
        status, headers, body = 0, {}, b""
        while not isinstance(event := conn.next_event(), h11.EndOfMessage):
            assert event is not h11.NEED_DATA, f"a truncated answer: {data!r}"
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
        yield status, headers, body
        data = conn.trailing_data[0]


def openai_error(body: bytes) -> dict[str, object]:
    err = json.loads(body)
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    return err["error"]  # type: ignore[no-any-return]


@PARSERS
async def test_length_and_chunked_together_get_400_and_the_connection_closes(router, parser):
    """Both header orders, on the hot paths and the app's (a POST-only path, a GET-only one, an
    unknown one): one 400 (OpenAI's shape where the request reaches the app: with h11; httptools
    refuses it in its parser, uvicorn's own 400), ``Connection: close``, then EOF: the request
    hidden in the chunked body (GET /workers, open in these tests: a 200) is never answered."""
    r = await router(workers=[], ready=False, server={"http": parser})
    port = r.server.port
    for path in (b"/route", b"/v1/chat/completions", b"/workers", b"/health", b"/nope"):
        for order in (
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
            b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
        ):
            request = b"POST %s HTTP/1.1\r\nHost: x\r\n%s\r\n0\r\n\r\n" % (path, order)
            answers, closed = await exchange(port, request + HIDDEN)
            assert [a[0] for a in answers] == [400], (parser, path, order, answers)
            assert closed, (parser, path, order)
            _, headers, body = answers[0]
            assert headers["connection"] == "close"
            if parser == "h11":
                assert "Content-Length and Transfer-Encoding" in str(openai_error(body)["message"])
    # with one of them, the same request is served, and so is the next one on its connection
    for framing in (b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n"):
        request = b"POST /health HTTP/1.1\r\nHost: x\r\n%s\r\n0\r\n\r\n" % framing
        closing = HIDDEN.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        answers, closed = await exchange(port, request + closing)
        assert [a[0] for a in answers] == [405, 200] and closed, (parser, framing)


async def _canary() -> tuple[asyncio.Server, list[int]]:
    """A listener that counts the connections it gets: the authority no request may reach."""
    hits: list[int] = []

    async def count(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append(1)
        writer.close()

    return await asyncio.start_server(count, "127.0.0.1", 0), hits


@PARSERS
async def test_absolute_form_targets_are_served_as_their_path(workers, router, parser):
    """``POST http://<authority>/route`` is ``/route`` (placed on the worker, whose URL the
    answer names), ``GET http://x/health`` is ``/health``, a proxied request goes to the worker
    it is placed on; the authority (a listener of the test's) never gets a connection."""
    w = await workers("a")
    r = await router([w], server={"http": parser})
    canary, hits = await _canary()
    try:
        authority = b"127.0.0.1:%d" % canary.sockets[0].getsockname()[1]
        body = json.dumps({"token_ids": list(range(40))}).encode()
        post = b"POST http://%s%%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" % (
            authority,
            authority,
        )
        [(status, _, answer)], _ = await exchange(
            r.server.port,
            post % b"/route"
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body),
        )
        assert status == 200, answer
        assert json.loads(answer)["worker_id"] == "a" and json.loads(answer)["url"] == w.url
        [(status, _, answer)], _ = await exchange(
            r.server.port,
            b"GET http://x/health?probe=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        assert (status, json.loads(answer)) == (200, {"status": "ok"})
        body = json.dumps({"model": w.model, "prompt": "hello", "max_tokens": 2}).encode()
        before = len(w.requests)
        [(status, headers, answer)], _ = await exchange(
            r.server.port,
            post % b"/v1/completions"
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body),
        )
        assert status == 200, answer
        assert headers["x-kvrouter-worker"] == "a" and len(w.requests) == before + 1
        assert hits == []
    finally:
        canary.close()
        await canary.wait_closed()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@PARSERS
async def test_websocket_upgrade_is_plain_http_and_logs_no_warning(router, parser):
    """The router has no WebSocket endpoint (``ws="none"``): ``Upgrade: websocket`` (and
    ``h2c``) requests are answered like plain ones, and uvicorn's "Unsupported upgrade request" /
    "No supported WebSocket library detected" warnings, which any client could write at will,
    are not logged."""
    r = await router(workers=[], ready=False, server={"http": parser, "keep_alive_timeout_s": 0.3})
    records = _Records()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(records)
    try:
        for upgrade in (
            b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n",
            b"Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n",
        ):
            request = b"GET /health HTTP/1.1\r\nHost: x\r\n%s\r\n" % upgrade
            answers, _ = await exchange(r.server.port, request)
            assert [(s, json.loads(b)) for s, _, b in answers[:1]] == [(200, {"status": "ok"})]
            assert "upgrade" not in answers[0][1]
        # the filter leaves uvicorn's other warnings alone
        uvicorn_log.warning("Invalid HTTP request received.")
    finally:
        uvicorn_log.removeHandler(records)
    assert not [m for m in records.messages if "upgrade" in m.lower() or "WebSocket" in m]
    assert "Invalid HTTP request received." in records.messages
