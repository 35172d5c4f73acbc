"""Issue 37: whom a warm start trusts, with real routers (in-process uvicorn on port 0), fake
workers publishing real ZMQ events, and a real aiohttp snapshot server on 127.0.0.1 that
records what it was sent and serves crafted bytes.

- Authentication: ``/admin/snapshot`` takes the peer key's token or the admin key, nothing
  else (401 in the router's error shape); a warm start with a peer key shows only its token,
  never the admin key; without one (the trusted-network mode) it shows the admin key.
- Item 7, a poisoned snapshot that copies the real seqs and ts: a real worker's rank credited
  with blocks it never stored, and a rank its worker does not have. The first is rebuilt from
  the worker's whole stream (still buffered), so the made-up blocks are never routed to, also
  after new live events; the second is dropped, counted, and not in the replica's own snapshot.
"""

from __future__ import annotations

import random

import msgspec
from replica_procs import candidate, metric, route, until

from router.runtime.replicas import SNAPSHOT_PATH, SNAPSHOT_TYPE, PeerKey

BS = 16
ADMIN_KEY = "the-admin-key-of-this-fleet"
SECRET = "0123456789abcdef0123456789abcdef"


def toks(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(blocks * BS)]


async def test_the_snapshot_takes_the_peer_token_and_a_warm_start_never_sends_the_admin_key(
    workers, router, http, snapshot_server, tmp_path
):
    key_file = tmp_path / "peer-key"
    key_file.write_text(SECRET)
    token = PeerKey.read(str(key_file)).snapshot_token()
    a = await workers("a")
    a.store(toks(1, 4))
    keyed = {"admin_key": ADMIN_KEY, "replicas": {"peer_key_file": str(key_file)}}
    peer = await router([a], **keyed)
    url = peer.url + SNAPSHOT_PATH
    for auth in (f"Bearer {token}", f"Bearer {ADMIN_KEY}"):
        got = await http.get(url, headers={"authorization": auth})
        assert got.status_code == 200 and got.headers["content-type"] == SNAPSHOT_TYPE
    for auth in ("Bearer not-the-token", f"Bearer {SECRET}", token, None):
        got = await http.get(url, headers={"authorization": auth} if auth else {})
        assert got.status_code == 401, auth
        assert got.json()["error"]["type"] == "authentication_error"
    body = (await http.get(url, headers={"authorization": f"Bearer {token}"})).content

    recorder = await snapshot_server(body)
    warm_from = {"warm_from": [recorder.url]}
    await router([a], **{**keyed, "replicas": {**keyed["replicas"], **warm_from}})
    await router([a], admin_key=ADMIN_KEY, replicas={"trusted_network": True, **warm_from})
    keyed_req, trusted_req = recorder.seen
    assert keyed_req["authorization"] == f"Bearer {token}"
    assert not any(ADMIN_KEY in v for v in keyed_req.values())
    # no peer key: the trusted-network mode shows the admin key, as before
    assert trusted_req["authorization"] == f"Bearer {ADMIN_KEY}"


async def test_a_poisoned_snapshot_with_the_real_seqs_neither_routes_nor_spreads(
    workers, router, http, snapshot_server
):
    a, b = await workers("a"), await workers("b")
    prefix = toks(2, 12)
    a.store(prefix)
    b.store(toks(3, 3))
    peer = await router([a, b], admin_key=ADMIN_KEY)
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}

    async def indexed() -> bool:
        return (await route(http, peer.url, prefix))["matched_blocks"] == 12

    await until(indexed, 20, "the peer indexed a's prefix")
    snap = msgspec.msgpack.decode((await http.get(peer.url + SNAPSHOT_PATH, headers=auth)).content)
    ranks = {(w["worker_id"], w["dp_rank"]): w for w in snap["workers"]}
    ra, rb = ranks[("a", 0)], ranks[("b", 0)]
    assert rb["seq"] is not None and rb["ts"] is not None  # (kept: the poison copies them)
    for col in ("engine_hashes", "router_hashes", "tiers"):  # b "holds" a's prefix too
        rb[col] = rb[col] + ra[col]
    snap["workers"].append({**ra, "dp_rank": 5})  # a rank worker a does not have
    poisoned = await snapshot_server(msgspec.msgpack.encode(snap))

    r = await router([a, b], admin_key=ADMIN_KEY, replicas={"warm_from": [poisoned.url]})
    assert poisoned.seen  # it did warm from the poisoned peer
    more = toks(4, 2)
    b.store(more)  # a new live event of b

    async def live() -> bool:
        return (await route(http, r.url, more))["matched_blocks"] == 2

    await until(live, 20, "b's new event indexed")
    got = await route(http, r.url, prefix)
    assert (got["worker_id"], got["matched_blocks"]) == ("a", 12)
    assert candidate(got, "b")["matched_blocks"] == 0  # b's made-up blocks are gone
    name = "kvrouter_snapshot_ranks_dropped_total"
    assert await metric(http, r.url, name, reason="unconfigured_rank") == 1
    assert await metric(http, r.url, name, reason="rebuilt") == 2  # a and b, from seq 0
    own = msgspec.msgpack.decode((await http.get(r.url + SNAPSHOT_PATH, headers=auth)).content)
    assert sorted((w["worker_id"], w["dp_rank"]) for w in own["workers"]) == [("a", 0), ("b", 0)]
