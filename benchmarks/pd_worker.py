"""The bare worker ``benchmarks/bench_pd.py`` measures against: vLLM's NIXL answers with no model
(``python benchmarks/pd_worker.py prefill|decode``: a uvloop + httptools server with fixed
answers, ``GET /last`` the last POST body it got, and a KV event socket that publishes nothing;
it prints ``worker URL events=ENDPOINT`` once listening)."""

from __future__ import annotations

import sys
from typing import Any

import msgspec

MODEL = "bench"
_enc = msgspec.json.Encoder().encode


def answers(role: str) -> tuple[bytes, bytes]:
    """A worker's fixed answers (JSON, SSE): vLLM's shapes, the prefill one with its params."""
    usage = {"prompt_tokens": 250, "completion_tokens": 16, "total_tokens": 266,
             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    head = {"id": "cmpl-bench-0", "object": "text_completion", "created": 0, "model": MODEL}
    choice = {"index": 0, "text": " ok" * 16, "finish_reason": "length", "logprobs": None}
    answer: dict[str, Any] = {**head, "choices": [choice], "usage": usage}
    if role == "prefill":
        answer["choices"] = [{**choice, "text": " ok"}]
        answer["usage"] = {**usage, "completion_tokens": 1, "total_tokens": 251}
        answer["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "5c1f1a7e-9a43-4f0e-8d3b-0c2b7a1f9e11",
            "remote_request_id": "cmpl-bench-0-842b3065",
            "remote_block_ids": [list(range(1, 17))], "remote_host": "127.0.0.1",
            "remote_port": 15600, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": 250, "remote_blocks_expiry_time": None,
            "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
        }  # fmt: skip
    pieces = [{**head, "choices": [{**choice, "text": " ok", "finish_reason": None}]}] * 16
    pieces.append({**head, "choices": [], "usage": usage})
    sse = b"".join(b"data: %s\n\n" % _enc(p) for p in pieces) + b"data: [DONE]\n\n"
    return _enc(answer), sse


def serve_worker(role: str) -> None:
    """The bare worker (``role``: prefill or decode): fixed answers, ``GET /last`` the last POST
    body it got; a leg that does not fit its role is answered 400."""
    import asyncio

    import httptools
    import uvloop
    import zmq

    pub: Any = zmq.Context.instance().socket(
        zmq.PUB
    )  # silent: the router is ready once it connects
    pub.bind("tcp://127.0.0.1:*")
    events = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    answer, sse = answers(role)
    models = _enc({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
    last = [b"{}"]

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]
            self.parser = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []
            self.url = b""

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_url(self, url: bytes) -> None:
            self.url = url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            body, self.body = b"".join(self.body), []
            if self.parser.get_method() != b"POST":
                got = {b"/last": last[0], b"/v1/models": models}.get(self.url, b"{}")
                return self.reply(200, b"application/json", got)
            last[0] = body
            if role == "prefill":
                ok = b'"do_remote_decode":true' in body and b'"stream":false' in body
            else:
                ok = b'"kv_transfer_params"' not in body or b'"do_remote_prefill":true' in body
            if not ok:
                return self.reply(400, b"application/json", b'{"error":"not this role\'s leg"}')
            if b'"stream":true' in body:
                return self.reply(200, b"text/event-stream", sse)
            self.reply(200, b"application/json", answer)

        def reply(self, status: int, ctype: bytes, data: bytes) -> None:
            head = b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            self.transport.write(head % (status, ctype, len(data)) + data)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        print(f"worker http://127.0.0.1:{port} events={events}", flush=True)
        await server.serve_forever()

    uvloop.run(main())


if __name__ == "__main__":
    serve_worker(sys.argv[1])
