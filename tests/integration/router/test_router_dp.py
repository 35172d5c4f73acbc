"""Data-parallel workers: rank r publishes on events port + r, is scored as its own candidate,
and requests placed on it carry ``X-Data-Parallel-Rank`` (vLLM's DP routing header)."""

from __future__ import annotations

import asyncio
import time

import zmq
from router_fakeworker import LOCAL

from indexer.events import BlockStored
from indexer.wire import encode_message, encode_payload


async def test_dp_rank_placement_and_header(workers, router, http, zctx):
    rank1 = None
    for i in range(10):  # rank 1 must publish on the port after rank 0's
        a = await workers(f"a{i}")
        port = int(a.events_endpoint.rsplit(":", 1)[1])
        sock = zctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"{LOCAL}:{port + 1}")
        except zmq.ZMQError:
            sock.close()
            continue
        rank1 = sock
        break
    assert rank1 is not None, "no consecutive free ports"
    try:
        r = await router([], workers=[a.spec(dp_ranks=2, replay_endpoint=None)])
        tokens = list(range(100, 164))  # 4 blocks
        seq = 0

        def publish() -> None:
            nonlocal seq
            ev = BlockStored(
                block_hashes=[11, 12, 13, 14],
                parent_block_hash=None,
                token_ids=tokens,
                block_size=16,
            )
            rank1.send_multipart(
                encode_message(b"", seq, encode_payload([ev], ts=time.time(), dp_rank=1))
            )
            seq += 1

        deadline = time.monotonic() + 20
        while r.matched(tokens, a.worker_id, 1) != 4:  # PUB drops until the SUB has joined
            assert time.monotonic() < deadline, "rank 1's events never arrived"
            publish()
            await asyncio.sleep(0.05)
        assert r.matched(tokens, a.worker_id, 0) == 0  # rank 0 holds nothing
        body = (await http.post(r.url + "/route", json={"token_ids": tokens})).json()
        assert (body["worker_id"], body["dp_rank"]) == (a.worker_id, 1)
        assert [c["dp_rank"] for c in body["candidates"]] == [0, 1]
        resp = await http.post(r.url + "/v1/completions", json={"prompt": [*tokens, 1, 2, 3]})
        assert resp.status_code == 200
        assert resp.headers["x-kvrouter-dp-rank"] == "1"
        assert a.request_headers[-1]["x-data-parallel-rank"] == "1"
    finally:
        rank1.close(linger=0)
