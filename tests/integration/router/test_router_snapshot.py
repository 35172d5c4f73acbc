"""Index snapshots: written at shutdown, loaded at start, then the worker replays from the
snapshotted seq (checked to be the same process) on."""

from __future__ import annotations

from router_fakeworker import wait_for

from indexer.index import PrefixIndex


async def test_restart_restores_the_index_and_replays_only_what_is_new(
    workers, router, http, tmp_path
):
    path = str(tmp_path / "index.snap")
    a = await workers("a")
    tokens = list(range(64))
    r1 = await router([a], snapshot={"path": path, "interval_s": 3600})
    a.store(tokens)  # seq 0
    await wait_for(lambda: r1.matched(tokens, "a") == 4, 20, "events applied")
    await r1.server.stop()  # the lifespan writes the snapshot

    a.replay_mode = "hold"  # from now on nothing comes back by replay: only the file can help
    before = len(a.replay_requests)
    r2 = await router([a], ready=False, snapshot={"path": path, "interval_s": 3600})
    body = (await http.post(r2.url + "/route", json={"token_ids": tokens})).json()
    assert body["matched_blocks"] == 4 and body["worker_id"] == "a"
    await wait_for(lambda: len(a.replay_requests) > before, 20, "replay request")
    # resumes from the snapshotted seq 0 itself: the same batch must come back first, or the
    # worker is a new process (issue 12)
    assert a.replay_requests[-1] == 0


async def test_unusable_snapshot_starts_empty(workers, router, http, tmp_path):
    path = tmp_path / "index.snap"
    path.write_bytes(b"not a snapshot")
    a = await workers("a")
    r = await router([a], snapshot={"path": str(path)})
    body = (await http.post(r.url + "/route", json={"token_ids": list(range(64))})).json()
    assert body["matched_blocks"] == 0


async def test_periodic_snapshots_are_written_while_the_router_serves(
    workers, router, http, tmp_path, caplog
):
    path = tmp_path / "index.snap"
    a = await workers("a")
    tokens = list(range(64))
    r = await router([a], snapshot={"path": str(path), "interval_s": 0.05})
    a.store(tokens)
    await wait_for(lambda: r.matched(tokens, "a") == 4, 20, "events applied")

    def restored_matches() -> bool:  # a complete file (written to .tmp, then renamed)
        if not path.exists():
            return False
        index, seqs = PrefixIndex.restore(path)
        return seqs.get(("a", 0)) == 0 and index.entries() == 4

    await wait_for(restored_matches, 20, "a periodic snapshot holding the stored blocks")
    # a write that fails (a directory where the file goes: the rename fails, even as root) is
    # logged, and the router goes on serving
    path.unlink()
    path.mkdir()
    await wait_for(lambda: "index snapshot to" in caplog.text, 20, "the failed write logged")
    body = (await http.post(r.url + "/route", json={"token_ids": tokens})).json()
    assert body["matched_blocks"] == 4
