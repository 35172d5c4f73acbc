"""``kvrouter route`` and ``kvrouter workers`` as real processes against a real router (uvicorn on
port 0, fake workers publishing KV events over ZMQ): the tables, the keys from the environment
or a file, and one-line errors for a refused key and a router that is not there."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

from router_fakeworker import wait_for

ROOT = Path(__file__).resolve().parents[3]
PREFIX = "You are a careful assistant. " * 20  # 580 bytes = 36 full blocks


async def kvrouter(*args: str, **env: str) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVROUTER_", "OPENAI_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**base, "PYTHONPATH": str(ROOT), **env}, cwd=str(ROOT),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def rows(table: str) -> dict[str, list[str]]:
    """A table's rows by worker id (the pick's ``*`` kept as the row's first cell)."""
    out = {}
    for line in table.splitlines()[2:]:
        cells = line.split()
        if cells and cells[0] == "*":
            out[cells[1]] = cells
        elif cells and not cells[0].startswith("("):
            out[cells[0]] = ["", *cells]
    return out


async def test_route_shows_every_candidate_and_marks_the_pick(workers, router, tmp_path):
    a = await workers("a", publish_on_request=False)
    b = await workers("b", publish_on_request=False)
    r = await router([a, b], api_keys=["client-key"])
    tokens = list(PREFIX.encode())
    b.store(tokens[:320])  # 20 blocks on GPU
    b.store(tokens, medium="CPU")  # all 36 in CPU memory (a block counts on its best tier)
    await wait_for(lambda: r.matched(tokens, "b") == 36, 10, "b's events")
    body = json.dumps({"model": "fake-model", "prompt": PREFIX + "x", "max_tokens": 4})

    code, out, err = await kvrouter("route", "--url", r.url, body, OPENAI_API_KEY="client-key")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("request: 36 full blocks of 16 tokens; pick: b")
    head = lines[1].split()
    assert head[:3] == ["worker", "rank", "matched"] and head[-3:] == ["predicted", "load", "cost"]
    assert "GPU" in head and "CPU_PINNED" in head
    got = rows(out)
    assert got["b"][0] == "*" and got["a"][0] == ""
    b_row = dict(zip(["mark", *head], got["b"]))
    assert b_row["matched"] == "36" and b_row["GPU"] == "20" and b_row["CPU_PINNED"] == "16"
    assert float(dict(zip(["mark", *head], got["a"]))["cost"]) > float(b_row["cost"])

    # the key from a file (the router's api_keys_file format), and the raw answer with --json
    keys = tmp_path / "keys"
    keys.write_text("# the client keys\nclient-key\n")
    code, out, err = await kvrouter(
        "route", "--url", r.url, "--api-key-file", str(keys), "--json", "--prompt", PREFIX
    )
    assert code == 0, err
    assert json.loads(out)["worker_id"] == "b"

    # no key: one line that says what to do
    code, out, err = await kvrouter("route", "--url", r.url, body)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvrouter route: /route: 401 ")
    assert "OPENAI_API_KEY or --api-key-file" in err


async def test_workers_lists_the_registry_with_its_event_streams(workers, router, tmp_path):
    a = await workers("a")
    b = await workers("b")
    r = await router([a, b], admin_key="admin-secret")
    a.store(list(PREFIX.encode()))
    await wait_for(lambda: r.matched(list(PREFIX.encode()), "a") == 36, 10, "a's events")

    code, out, err = await kvrouter("workers", "--url", r.url, KVROUTER_ADMIN_KEY="admin-secret")
    assert code == 0, err
    head = out.splitlines()[0].split()
    assert head == [
        "id",
        "url",
        "role",
        "health",
        "events",
        "lag_s",
        "last_s",
        "blocks",
        "inflight",
    ]
    table = {line.split()[0]: dict(zip(head, line.split())) for line in out.splitlines()[1:]}
    assert set(table) == {"a", "b"}
    assert table["a"]["url"] == a.url and table["a"]["role"] == "both"
    assert table["a"]["events"] == "live" and table["a"]["blocks"] == "GPU:36"
    assert table["b"]["blocks"] == "0" and table["a"]["inflight"] == "0"
    assert float(table["a"]["last_s"]) >= 0

    keyfile = tmp_path / "admin"
    keyfile.write_text("admin-secret\n")
    code, out, err = await kvrouter("workers", "--url", r.url, "--admin-key-file", str(keyfile))
    assert code == 0 and out.startswith("id "), err

    code, out, err = await kvrouter("workers", "--url", r.url, KVROUTER_ADMIN_KEY="wrong")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("kvrouter workers: /workers: 401 ")
    assert "KVROUTER_ADMIN_KEY or --admin-key-file" in err


async def test_a_router_that_is_not_there_is_one_line():
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        code, out, err = await kvrouter("workers", "--url", url)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"kvrouter workers: cannot reach the router at {url}: ")
    assert "is it running?" in err
    code, _, err = await kvrouter("route", "--url", url, "not json")
    assert code == 1 and err.startswith("kvrouter route: the body is not JSON")
