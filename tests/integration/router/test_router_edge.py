"""The HTTP edge against hostile peers (issue 11), over real sockets: workers that break HTTP
framing (small raw asyncio servers on 127.0.0.1 that send exactly the bytes each case needs) and
clients that send what no well-behaved client would (raw sockets and the official clients)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from router_fakeworker import wait_for

from router.settings import WorkerConfig

Answer = Callable[[bytes], Awaitable[bytes]]


class RawWorker:
    """An OpenAI-ish worker written at the byte level: answers GET /health and /v1/models
    properly and every POST with ``answer(request)``; counts the POSTs it received."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.posts: list[bytes] = []
        self.heads: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.connections = 0
        self._open: set[asyncio.StreamWriter] = set()
        self.stopped = False

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.stopped:
            # accepted before stop() but handled after it (a loaded machine runs the handler
            # late): close it as stop() closed the others, or a request pooled on it would wait
            # for an answer from a worker that is gone
            w.close()
            return
        self.connections += 1
        self._open.add(w)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":")[1])
                body = await r.readexactly(n)
                if head.startswith(b"GET "):
                    data = b'{"object":"list","data":[]}'
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
                else:
                    self.posts.append(body)
                    self.heads.append(head)
                    w.write(await self.answer(body))
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._open.discard(w)
            w.close()

    async def stop(self) -> None:
        """Stop listening and close the open connections (the router's pooled ones too)."""
        assert self.server is not None
        self.stopped = True
        self.server.close()
        for w in list(self._open):
            w.close()
        await self.server.wait_closed()

    async def start(self) -> RawWorker:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def spec(self, wid: str) -> dict[str, object]:
        with socket.socket() as s:  # an event endpoint nobody publishes on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return {"id": wid, "url": self.url, "events_endpoint": f"tcp://127.0.0.1:{port}"}


@pytest.fixture
async def raw() -> AsyncIterator[Callable[[Answer], Awaitable[RawWorker]]]:
    made: list[RawWorker] = []

    async def make(answer: Answer) -> RawWorker:
        made.append(await RawWorker(answer).start())
        return made[-1]

    yield make
    for w in made:
        assert w.server is not None
        w.server.close()


def fixed(data: bytes) -> Answer:
    async def answer(_: bytes) -> bytes:
        return data

    return answer


async def routed(router, workers: list[tuple[str, RawWorker]], **settings):  # type: ignore[no-untyped-def]
    r = await router(workers=[w.spec(wid) for wid, w in workers], ready=False, **settings)
    ids = {wid for wid, _ in workers}
    await wait_for(
        lambda: sum(st.healthy for st in r.state.registry.states() if st.id in ids) == len(ids),
        20,
        "healthy",
    )
    return r


def err(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return str(body["error"]["message"])


async def test_overlong_body_never_reaches_the_next_client(router, raw, http) -> None:
    """A worker answering ``{"a":1}`` under ``Content-Length: 2``: the next client gets its own
    answer, never the 5 bytes left over from the first."""
    n = 0

    async def answer(_: bytes) -> bytes:
        nonlocal n
        n += 1
        if n == 1:
            return b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{"a":1}'
        data = b'{"n":%d}' % n
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)

    w = await raw(answer)
    r = await routed(router, [("w", w)])
    first = await http.post(r.url + "/v1/completions", json={"prompt": "one"})
    assert first.status_code in (200, 502) and b":1}" not in first.content
    second = await http.post(r.url + "/v1/completions", json={"prompt": "two"})
    assert second.status_code == 200 and second.json() == {"n": 2}


@pytest.mark.parametrize("keepalive_s", [2.0, 0.0])
async def test_worker_connections_are_reused_only_while_kept_alive(
    router, raw, http, keepalive_s
) -> None:
    """``proxy.keepalive_s``: 4 requests in a row share one kept-alive connection (a health
    check may hold a second at the same moment); with 0, each opens its own."""
    w = await raw(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"))
    r = await routed(router, [("w", w)], proxy={"keepalive_s": keepalive_s})
    before = w.connections
    for i in range(4):
        assert (await http.post(r.url + "/v1/completions", json={"prompt": f"k{i}"})).is_success
    opened = w.connections - before
    assert opened <= 2 if keepalive_s else opened >= 4, opened


async def test_a_post_goes_to_one_worker_once(router, raw, http) -> None:
    """Junk instead of a response: 502, and no second copy to this or any other worker."""
    bad = await raw(fixed(b"this is not HTTP\r\n\r\n"))
    good = await raw(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"))
    r = await routed(router, [("bad", bad), ("good", good)], proxy={"retries": 2})
    got = []
    for i in range(6):
        resp = await http.post(r.url + "/v1/completions", json={"prompt": f"p{i}" * 40})
        got.append((resp.status_code, resp.headers.get("x-kvrouter-worker")))
    assert len(bad.posts) + len(good.posts) == 6  # one copy per request, whatever happened
    assert {s for s, _ in got} <= {200, 502}


async def test_a_refused_connection_moves_to_the_next_worker(router, raw, http, request) -> None:
    good = await raw(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"))
    gone = await raw(fixed(b""))
    r = await routed(router, [("gone", gone), ("good", good)])
    port = int(gone.url.rsplit(":", 1)[1])
    await gone.stop()  # nothing listens: provably received nothing
    # and the port stays bound, never listening: no other server can take it, nor can a
    # connection to it get it as its own ephemeral port (a TCP self-connect, which succeeds)
    hold = socket.socket()
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.bind(("127.0.0.1", port))
    request.addfinalizer(hold.close)
    for i in range(4):
        resp = await http.post(r.url + "/v1/completions", json={"prompt": f"q{i}"})
        assert resp.status_code == 200 and resp.headers["x-kvrouter-worker"] == "good"


@pytest.mark.parametrize("ctype", [b"text/plain\rX-Evil: 1", b"text/plain\nX-Evil: 1"])
async def test_worker_headers_never_reach_the_client_raw(router, raw, http, ctype) -> None:
    w = await raw(
        fixed(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: 2\r\n\r\n{}")
    )
    r = await routed(router, [("w", w)])
    resp = await http.post(r.url + "/v1/completions", json={"prompt": "x"})
    assert "x-evil" not in resp.headers
    assert resp.status_code in (200, 502)
    if resp.status_code == 200:
        assert resp.headers["content-type"] in ("application/json", "text/plain")


def test_worker_ids_are_plain_names() -> None:
    for bad in ("a\r\nX-Evil: 1", "a b", "", "a/b", "x" * 129, "é"):
        with pytest.raises(ValueError, match="`id`"):
            WorkerConfig(id=bad, url="http://h:1", events_endpoint="tcp://h:2")
    WorkerConfig(id="vllm-0.pod:1_a", url="http://h:1", events_endpoint="tcp://h:2")


async def test_admin_endpoints_are_closed_without_a_key(router, http) -> None:
    r = await router(workers=[], ready=False, admin_open=False)
    spec = {"id": "x", "url": "http://169.254.169.254", "events_endpoint": "tcp://127.0.0.1:1"}
    assert "admin_key" in err(await http.get(r.url + "/workers"), 403)
    assert "admin_key" in err(await http.post(r.url + "/workers", json=spec), 403)
    err(await http.delete(r.url + "/workers/x"), 403)
    assert [st.id for st in r.state.registry.states()] == []  # nothing registered or called


@pytest.mark.parametrize("path", ["/route", "/v1/completions", "/v1/chat/completions"])
async def test_malformed_json_is_a_400(router, http, path) -> None:
    r = await router(workers=[], ready=False)
    for body in (b'{"prompt":"\xff"}', b'{"prompt": "a"' + b" " * 10):
        err(await http.post(r.url + path, content=body), 400)
    nested = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b', "messages": []}'
    resp = await http.post(r.url + path, content=nested)
    assert resp.status_code in (400, 422)  # a clear client error, never a 500
    err(resp, resp.status_code)


async def test_route_rejects_token_ids_out_of_range(router, http) -> None:
    r = await router(workers=[], ready=False)
    for ids in ([-1, 2], [2, 1 << 63], [1 << 64]):
        assert "token_ids" in err(await http.post(r.url + "/route", json={"token_ids": ids}), 422)


async def test_overall_head_deadline_and_body_cap(router, raw, http) -> None:
    async def trickle(_: bytes) -> bytes:
        await asyncio.sleep(0.6)  # pacing of the hostile worker before its head
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"

    slow = await raw(trickle)
    r = await routed(router, [("slow", slow)], proxy={"read_timeout_s": 0.3, "retries": 0})
    err(await http.post(r.url + "/v1/completions", json={"prompt": "x"}), 504)

    big = b"x" * (2 << 20)
    huge = await raw(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)))
    r2 = await routed(router, [("huge", huge)], proxy={"max_response_bytes": 1 << 20})
    assert "BodyTooLarge" in err(
        await http.post(r2.url + "/v1/completions", json={"prompt": "x"}), 502
    )


async def test_half_sent_body_times_out(router) -> None:
    r = await router(workers=[], ready=False, server={"body_timeout_s": 0.3})
    port = int(r.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b'POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"tok')
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 408 ")
    writer.close()


async def test_post_with_h2c_upgrade_keeps_its_body(router) -> None:
    r = await router(workers=[], ready=False)
    port = int(r.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"token_ids": [1, 2, 3]}'
    writer.write(
        b"POST /route HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert not head.startswith(b"HTTP/1.1 400"), head
    assert head.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 503 ")), head  # 503: no worker here


async def test_unfinished_oversized_head_is_refused(router) -> None:
    r = await router(workers=[], ready=False, server={"max_header_bytes": 8192})
    port = int(r.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    try:  # an unfinished head that keeps growing: refused, not buffered to the end
        for _ in range(64):
            writer.write(b"a" * 16384)
            await writer.drain()
    except ConnectionError:
        pass
    answer = await asyncio.wait_for(reader.read(4096), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400 ") or answer == b"", answer[:80]


@pytest.mark.parametrize("level", ["INFO", "WARNING"])
async def test_request_id_echoed_forwarded_and_logged(router, raw, http, caplog, level) -> None:
    """With the access log on (INFO) and off: the id is echoed, forwarded and generated alike."""
    w = await raw(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"))
    r = await routed(router, [("w", w)])
    caplog.set_level(level, logger="kvrouter.access")
    resp = await http.post(
        r.url + "/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "abc-123"}
    )
    assert resp.headers["x-request-id"] == "abc-123"
    assert b"x-request-id: abc-123\r\n" in w.heads[-1].lower()  # forwarded to the worker
    made = await http.post(r.url + "/v1/completions", json={"prompt": "x"})
    rid = made.headers["x-request-id"]  # generated, forwarded
    assert len(rid) == 32 and b"x-request-id: %s\r\n" % rid.encode() in w.heads[-1].lower()
    bad = await http.get(r.url + "/health", headers={"x-request-id": "no spaces allowed"})
    assert bad.headers["x-request-id"] != "no spaces allowed"
    lines = [rec for rec in caplog.records if rec.name == "kvrouter.access"]
    if level == "WARNING":
        assert not lines
        return
    proxied = [rec.access for rec in lines if rec.access["request_id"] == "abc-123"]  # type: ignore[attr-defined]
    assert proxied and proxied[0]["status"] == 200 and proxied[0]["worker"] == "w"
    assert proxied[0]["path"] == "/v1/completions" and proxied[0]["bytes"] == 2


async def test_client_api_keys_guard_the_api_and_stay_in_the_router(router, raw, http) -> None:
    w = await raw(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"))
    r = await routed(router, [("w", w)], api_keys=["k1", "k2"])
    for path, body in (("/route", {"token_ids": [1, 2]}), ("/v1/completions", {"prompt": "x"})):
        assert "Bearer" in err(await http.post(r.url + path, json=body), 401)
        bad = {"Authorization": "Bearer nope"}
        err(await http.post(r.url + path, json=body, headers=bad), 401)
        ok = await http.post(r.url + path, json=body, headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200, ok.text
    err(await http.get(r.url + "/v1/models"), 401)
    assert (await http.get(r.url + "/health")).status_code == 200  # liveness stays open
    assert b"authorization" not in w.heads[-1].lower()  # the router's key never reaches a worker


async def test_static_worker_without_events_reads_kv_event_sources(router, workers, http) -> None:
    """``--worker id=v0,url=...`` is enough for a vLLM: the event endpoints come from its
    ``GET /kv_event_sources`` (a wildcard bind address becomes the worker URL's host). Served
    here by a real HTTP server in front of a real publisher."""
    from router_fakeworker import ServerHandle
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    w = await workers("v0")
    port = w.events_endpoint.rsplit(":", 1)[1]
    replay_port = w.replay_endpoint.rsplit(":", 1)[1] if w.replay_endpoint else None

    async def sources(request: Request) -> Response:
        # vLLM 0.32's shape (seen from a real one): data-parallel rank -> its events config
        src = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
        if replay_port:
            src["replay_endpoint"] = f"tcp://*:{replay_port}"
        return JSONResponse({"0": src})

    front = await ServerHandle(Starlette(routes=[Route("/kv_event_sources", sources)])).start()
    try:
        r = await router(workers=[{"id": "v0", "url": front.url}], ready=False)
        cfg = r.state.registry.workers["v0"].config
        assert cfg.events_endpoint == f"tcp://127.0.0.1:{port}"
        tokens = list(range(64))
        w.store(tokens)
        await wait_for(
            lambda: r.matched(tokens, "v0") == 4, 20, "events from the discovered socket"
        )
    finally:
        await front.stop()


async def test_connection_cap_answers_503_and_frees_when_clients_leave(router) -> None:
    """``server.max_connections`` (uvicorn's limit_concurrency): with the cap's worth of idle
    connections open, a request on one more gets 503, not a hang; once they close, 200 again."""
    r = await router(workers=[], ready=False, server={"max_connections": 6})
    port = int(r.url.rsplit(":", 1)[1])
    conns = r.server.server.server_state.connections  # uvicorn.Server's open connections
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(6)]
    await wait_for(lambda: len(conns) >= 6, 10, "the idle connections accepted")

    async def status() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
        writer.close()
        return head

    assert (await status()).startswith(b"HTTP/1.1 503 ")
    for _, writer in idle:
        writer.close()
    await wait_for(lambda: not conns, 10, "the idle connections gone")
    assert (await status()).startswith(b"HTTP/1.1 200 ")
