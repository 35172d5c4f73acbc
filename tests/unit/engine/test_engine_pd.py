"""The bundled engine as a prefill/decode pair (``--role``), sim runner, real processes: vLLM's
NIXL-pull exchange over the prefill engine's block endpoint, the decode engine's events for what
it pulled, the prefill engine's leases, and every way a pull can fail, under both
``--kv-load-failure-policy`` values."""

from __future__ import annotations

import random
import signal
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from engine_helpers import make_engine, run
from pd_helpers import PREFILL_LEG, Engine, engines, gpu_stores
from prometheus_client.parser import text_string_to_metric_families

from engine.config import ConfigError, ServerSettings
from engine.engine import LLMEngine
from engine.pd.leases import LeaseTable
from engine.pd.params import KvTransferError
from engine.pd.side_channel import BlockEndpoint, advertised_host, pull
from engine.pd.wire import PullRequest
from engine.runner.base import RunnerConfig
from engine.runner.sim import SimRunner
from engine.sequence import RemoteKV, Request
from indexer.hosts import is_wildcard
from tests.waiting import poll

BS = 16
SIM = ["--speedup", "100", "--block-size", str(BS)]


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Engine]]:
    with engines(
        ["--role", "prefill", *SIM],
        ["--role", "prefill", "--kv-lease-s", "0.3", *SIM],
        ["--role", "decode", "--cpu-blocks", "256", *SIM],
        ["--role", "decode", "--kv-load-failure-policy", "recompute", *SIM],
        # bound on every interface, as in the Dockerfile and the Kubernetes overlay
        ["--role", "prefill", "--kv-host", "0.0.0.0", "--kv-advertise-host", "127.0.0.1", *SIM],
    ) as (p, short, d, r, wild):
        yield {"p": p, "short": short, "d": d, "r": r, "wild": wild}


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def _prefill(p: Engine, ids: list[int]) -> dict[str, Any]:
    r = p.post({"prompt": ids, "max_tokens": 1, "kv_transfer_params": PREFILL_LEG})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]  # type: ignore[no-any-return]


def _decode(d: Engine, ids: list[int], kv: dict[str, Any] | None) -> Any:
    body: dict[str, Any] = {"prompt": ids, "max_tokens": 8, "temperature": 0}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return d.post(body)


def test_a_decode_engine_pulls_the_prefilled_blocks_and_publishes_them(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    ids = _ids(1, 100)
    kv = _prefill(p, ids)
    assert kv["do_remote_prefill"] is True and kv["remote_num_tokens"] == 100
    assert (kv["remote_host"], kv["remote_port"]) == p.kv and kv["transfer_mode"] == "pull"
    assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == (100 - 1) // BS
    assert p.transfers()["leases"]["held"] == 1
    before = d.transfers()
    got = _decode(d, ids, kv)
    assert got.status_code == 200, got.text
    after = d.transfers()
    # the six full blocks came over the wire and reached the GPU pool (the sim checked each
    # block's payload, a digest of its prefix's tokens, before attending to it)
    assert after["loaded_blocks"] - before["loaded_blocks"] == 6
    assert after["pulls"]["pulled"] == before["pulls"]["pulled"] + 1
    leases = p.transfers()["leases"]  # released on the pull
    assert (leases["held"], leases["blocks"]) == (0, 0) and leases["ended"]["pulled"] >= 1
    blocks = [ids[i * BS : (i + 1) * BS] for i in range(6)]
    assert gpu_stores(d.replay)[:6] == blocks
    # and written through to its CPU_PINNED tier like blocks it computed
    poll(lambda: gpu_stores(d.replay, "CPU_PINNED")[:6] == blocks, 20, "CPU_PINNED copies")
    # the same text as the whole request on one engine (greedy: a function of the KV)
    whole = _decode(p, ids, None).json()["choices"][0]["text"]
    assert got.json()["choices"][0]["text"] == whole


def test_the_decode_engine_reports_the_prefill_engines_hit_as_cached(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    head = _ids(2, 64)
    _decode(d, head + _ids(3, 40), _prefill(p, head + _ids(3, 40)))
    ids = head + _ids(4, 40)
    kv = _prefill(p, ids)
    assert kv["remote_prefill_cached_tokens"] == 64
    assert _decode(d, ids, kv).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_a_decode_engine_pulls_only_the_blocks_it_lacks(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    head = _ids(12, 64)
    ids = head + _ids(13, 40)
    _decode(d, ids, _prefill(p, ids))  # the decode engine holds the head's 4 blocks now
    ids = head + _ids(14, 40)  # 6 full blocks to pull, the first 4 held
    before = d.transfers()
    got = _decode(d, ids, _prefill(p, ids))
    after = d.transfers()
    assert got.status_code == 200, got.text
    assert after["pulled_blocks"] - before["pulled_blocks"] == 2
    assert after["loaded_blocks"] - before["loaded_blocks"] == 2
    assert p.transfers()["leases"]["held"] == 0  # the lease ends all the same
    assert got.json()["choices"][0]["text"] == _decode(p, ids, None).json()["choices"][0]["text"]


def test_many_pd_requests_at_once_pass_the_payload_checks(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    from concurrent.futures import ThreadPoolExecutor

    prompts = [_ids(100 + i % 5, 48) + _ids(200 + i, 30 + i) for i in range(16)]

    def one(ids: list[int]) -> tuple[int, str]:
        r = _decode(d, ids, _prefill(p, ids))
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, prompts))
    whole = [_decode(p, ids, None).json()["choices"][0]["text"] for ids in prompts]
    assert got == [(200, w) for w in whole]


def _refused(d: Engine, ids: list[int], kv: dict[str, Any], why: str) -> None:
    r = _decode(d, ids, kv)
    assert r.status_code == 500 and "KV load failed" in r.text and why in r.text, r.text


def _pd_metrics(e: Engine) -> dict[tuple[str, str], float]:
    """The engine's ``kvrouter_engine_pd_*`` samples: (name, its reason/how label or "")."""
    text = httpx.get(e.url + "/metrics", timeout=10).text
    return {
        (s.name, s.labels.get("reason") or s.labels.get("how") or ""): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("kvrouter_engine_pd_")
    }


def test_the_pd_counters_on_metrics(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    p0, d0 = _pd_metrics(p), _pd_metrics(d)
    ids = _ids(30, 90)  # (90 - 1) // 16 = 5 full blocks, none of them on d yet
    kv = _prefill(p, ids)
    assert _decode(d, ids, kv).status_code == 200
    _refused(d, ids, kv, "already pulled")
    p1, d1 = _pd_metrics(p), _pd_metrics(d)

    def grew(before: dict, after: dict, name: str, label: str = "") -> float:
        key = (f"kvrouter_engine_pd_{name}_total", label)
        return after[key] - before.get(key, 0.0)

    assert grew(p0, p1, "pulls_served") == 1 and grew(p0, p1, "leases_opened") == 1
    assert grew(p0, p1, "pulls_refused", "unknown_transfer") == 1
    assert grew(p0, p1, "leases_ended", "pulled") == 1
    assert p1[("kvrouter_engine_pd_leases_held", "")] == 0
    assert grew(d0, d1, "pulls_done") == 1 and grew(d0, d1, "pulled_blocks") == 5
    assert grew(d0, d1, "pulled_bytes") == 5 * d.transfers()["block_bytes"] > 0
    assert grew(d0, d1, "pulls_failed", "refused") == 1
    assert grew(d0, d1, "pulls_failed", "timeout") == 0  # every reason is there, zeros too


@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        (lambda kv: kv.update(remote_request_id="cmpl-nope"), "unknown transfer"),
        (lambda kv: kv.update(remote_engine_id="0000"), "it restarted"),
        (lambda kv: kv["remote_block_ids"][0].pop(), "names 5 blocks"),
        (lambda kv: kv["remote_block_ids"][0].reverse(), "the lease holds"),
        (lambda kv: kv.update(remote_num_tokens=99), "prefilled 99 tokens"),
        (lambda kv: kv.pop("remote_host"), "lack remote_engine_id"),
    ],
)
def test_bad_params_fail_clearly_or_are_recomputed(fleet, tamper, why) -> None:
    p, d, r = fleet["p"], fleet["d"], fleet["r"]
    ids = _ids(5, 100)
    whole = _decode(p, ids, None).json()["choices"][0]["text"]
    kv = _prefill(p, ids)
    tamper(kv)
    _refused(d, ids, dict(kv), why)
    before = r.transfers()["pulls"]["recomputed"]
    ok = _decode(r, ids, kv)  # recompute: prefilled on the decode engine, the same answer
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == whole
    assert r.transfers()["pulls"]["recomputed"] == before + 1


def test_a_transfer_is_pulled_once_and_only_for_its_prompt(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    ids = _ids(6, 80)
    kv = _prefill(p, ids)
    other = [*ids[:-1], (ids[-1] + 1 - 32) % 95 + 32]  # the same blocks: same hashes, pulled
    assert _decode(d, other, kv).status_code == 200
    _refused(d, ids, kv, "already pulled")
    kv = _prefill(p, ids)
    _refused(d, _ids(7, 80), kv, "other tokens")  # same length, other tokens: hashes differ


def test_an_expired_lease_is_released_and_refused(fleet) -> None:
    short, d = fleet["short"], fleet["d"]
    ids = _ids(8, 70)
    kv = _prefill(short, ids)
    poll(lambda: short.transfers()["leases"]["ended"]["expired"] >= 1, 20, "the lease expired")
    assert short.transfers()["leases"]["blocks"] == 0
    _refused(d, ids, kv, "lease (0.3 s) ended")


def test_roles_refuse_the_other_leg(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    ids = _ids(9, 40)
    r = d.post({"prompt": ids, "max_tokens": 1, "kv_transfer_params": PREFILL_LEG})
    assert r.status_code == 400 and "role is decode" in r.text
    kv = _prefill(p, ids)
    r = _decode(p, ids, kv)
    assert r.status_code == 400 and "role is prefill" in r.text
    r = p.post({"prompt": ids, "stream": True, "kv_transfer_params": PREFILL_LEG})
    assert r.status_code == 400 and "not streamed" in r.text


def test_a_prefill_engine_gone_before_the_pull(fleet) -> None:
    d, r = fleet["d"], fleet["r"]
    ids = _ids(10, 60)
    with engines(["--role", "prefill", *SIM]) as (gone,):
        kv = _prefill(gone, ids)
        gone.child.proc.send_signal(signal.SIGKILL)
        gone.child.proc.wait(10)
    _refused(d, ids, kv, "failed")
    assert _decode(r, ids, kv).status_code == 200


def test_a_prefill_engine_gone_mid_pull(fleet) -> None:
    """A block endpoint that dies after half an answer: the decode engine's read ends early."""
    p, d = fleet["p"], fleet["d"]
    ids = _ids(11, 60)
    kv = _prefill(p, ids)
    srv = socket.create_server(("127.0.0.1", 0))

    def half_answer() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(struct.pack(">I", 4096) + b"\x80" * 100)

    t = threading.Thread(target=half_answer, daemon=True)
    t.start()
    kv["remote_port"] = srv.getsockname()[1]
    try:
        _refused(d, ids, kv, "mid-frame")
    finally:
        t.join(10)
        srv.close()


def test_a_wildcard_bound_endpoint_advertises_the_given_host_and_is_pulled_from(fleet) -> None:
    wild, d = fleet["wild"], fleet["d"]
    assert wild.transfers()["endpoint"].startswith("0.0.0.0:")
    ids = _ids(12, 70)
    kv = _prefill(wild, ids)
    assert (kv["remote_host"], kv["remote_port"]) == wild.kv and wild.kv[0] == "127.0.0.1"
    before = d.transfers()["pulls"]["pulled"]
    got = _decode(d, ids, kv)
    assert got.status_code == 200, got.text
    assert d.transfers()["pulls"]["pulled"] == before + 1
    assert wild.transfers()["leases"]["ended"]["pulled"] == 1


async def _refuse(req: PullRequest) -> Any:
    raise KvTransferError("no such transfer", "unknown_transfer")


@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])
async def test_a_wildcard_bind_advertises_a_concrete_address_that_reaches_it(bind) -> None:
    # (no skip: IPv6 loopback, [::1], is on every machine this project runs on)
    ep = await BlockEndpoint(_refuse, host=bind, port=0).start()
    try:
        host = advertised_host(ep.host)
        assert host and not is_wildcard(host) and ep.host == bind
        assert advertised_host("10.1.2.3") == "10.1.2.3"  # a specific bind is its own address
        # the endpoint answers there (its refusal is its answer: the connection was made)
        req = PullRequest(engine_id="e", transfer_id="t", block_ids=[1])
        with pytest.raises(KvTransferError) as exc:
            await pull(host, ep.port, req, block_bytes=8, timeout=5)
        assert exc.value.reason == "refused" and ep.refused == {"unknown_transfer": 1}
    finally:
        await ep.close()


async def test_a_decode_engine_takes_an_ipv6_remote_host_bare_or_bracketed() -> None:
    ep = await BlockEndpoint(_refuse, host="::1", port=0).start()
    try:
        req = PullRequest(engine_id="e", transfer_id="t", block_ids=[1])
        for host in ("::1", "[::1]"):
            with pytest.raises(KvTransferError, match="refused: no such transfer"):
                await pull(host, ep.port, req, block_bytes=8, timeout=5)
        assert ep.refused == {"unknown_transfer": 2}
    finally:
        await ep.close()


@pytest.mark.parametrize("bad", ["0.0.0.0", "::", "*", "", "[::1]", "10.0.0.1:5600", "a b"])
def test_a_bad_kv_advertise_host_is_refused(bad) -> None:
    with pytest.raises(ConfigError, match="--kv-advertise-host must be an address"):
        ServerSettings(kv_advertise_host=bad)
    assert ServerSettings(kv_advertise_host="::1").kv_advertise_host == "::1"


def test_the_sim_times_a_pull_by_bytes_over_bandwidth_plus_latency() -> None:
    sim = SimRunner(RunnerConfig(block_size=16, num_gpu_blocks=8, num_host_slots=2))
    nbytes = 10 * sim.modeled_block_bytes
    assert sim.copy_s(10, "REMOTE") == pytest.approx(nbytes / 12.5e9 + 1e-3)
    assert sim.io_delay("REMOTE", 10 * sim.kv_block_bytes) == sim.copy_s(10, "REMOTE")


def test_the_lease_table_is_bounded_and_ends_leases_on_time() -> None:
    now = [0.0]
    held: list[int] = []
    table = LeaseTable(
        lambda ids: [held.remove(b) for b in ids], lease_s=5, max_blocks=4, max_leases=2,
        clock=lambda: now[0],
    )  # fmt: skip
    grant = dict(num_tokens=40, cached_tokens=0, hold=held.extend)
    table.grant("a", (1, 2), (11, 12), **grant)
    table.grant("b", (3,), (13,), **grant)
    table.grant("c", (4, 5), (14, 15), **grant)  # over both bounds: "a" ends first
    assert "a" not in table and held == [3, 4, 5] and table.ended["evicted"] == 1
    assert table.grant("big", (6, 7, 8, 9, 10), (0,) * 5, **grant) is None  # never fits
    now[0] = 6.0
    with pytest.raises(KvTransferError, match="unknown transfer 'b'"):
        table.take("b")
    assert held == [] and table.ended["expired"] == 2


def _pulled(p: LLMEngine, rid: str, ids: list[int]) -> RemoteKV:
    """Prefill ``ids`` on ``p`` as a prefill leg and read its lease, as the block endpoint does."""
    out = run(p, rid, ids, kv_hold=True)
    assert out.kv_lease is not None
    _, blobs = p.export_lease(rid, list(out.kv_lease.block_ids))
    return RemoteKV(blobs)


def test_pulled_blocks_wait_for_staging_slots_and_load_chunk_by_chunk() -> None:
    """More pulled blocks than staging slots load in chunks of the slots as each load gives
    them back: the decode engine computes only the prompt's partial block (pinned host memory
    stays bounded, and nothing pulled is computed again)."""
    p = make_engine(block_size=BS, num_gpu_blocks=64)
    d = make_engine(block_size=BS, num_gpu_blocks=64, num_staging_slots=4)
    whole = make_engine(block_size=BS, num_gpu_blocks=64)
    try:
        a, b, c = _ids(20, 50), _ids(21, 50), _ids(22, 100)  # 3, 3 and 6 blocks to pull
        for rid, ids in (("a", a), ("b", b)):  # both at once: "b" waits for "a"'s slots
            d.add_request(Request(rid, ids, 4, remote_kv=_pulled(p, rid, ids)))
        got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
        for out in d.run_until_idle():
            got[out.request_id] += out.new_token_ids
        assert d.tiers.loaded_blocks["REMOTE"] == 6
        computed = d.runner.prefill_tokens
        d.add_request(Request("c", c, 4, remote_kv=_pulled(p, "c", c)))
        for out in d.run_until_idle():
            got[out.request_id] += out.new_token_ids
        assert d.tiers.loaded_blocks["REMOTE"] == 6 + 6  # 4 slots: a chunk of 4, then of 2
        assert d.runner.prefill_tokens - computed == 100 - 6 * BS  # only the partial block
        assert d.tiers.host is not None and d.tiers.host.num_free_staging == 4
        for rid, ids in (("a", a), ("b", b), ("c", c)):
            whole.add_request(Request(rid, ids, 4))
        want: dict[str, list[int]] = {"a": [], "b": [], "c": []}
        for out in whole.run_until_idle():
            want[out.request_id] += out.new_token_ids
        assert got == want
        assert len(p.leases) == 0 and p.bm.num_free_blocks == 64  # every lease released
    finally:
        for e in (p, d, whole):
            e.close()


def test_a_decode_leg_aborted_between_chunks_gives_every_block_back() -> None:
    p = make_engine(block_size=BS, num_gpu_blocks=64)
    d = make_engine(block_size=BS, num_gpu_blocks=64, num_staging_slots=2)
    try:
        ids = _ids(23, 120)  # 7 blocks to pull through 2 slots: 4 chunks
        d.add_request(Request("x", ids, 4, remote_kv=_pulled(p, "x", ids)))
        d.step()  # admitted: its first chunk is loading
        assert [s.request_id for s in d.scheduler.loading.values()] == ["x"]
        assert d.abort("x")
        d.run_until_idle()
        assert not d.scheduler.loading and d.tiers.loaded_blocks["REMOTE"] <= 4
        assert d.bm.num_free_blocks == 64 and d.tiers.host is not None
        assert d.tiers.host.num_free_staging == 2
    finally:
        for e in (p, d):
            e.close()
