"""Keys from files, as a real ``python -m router serve`` process (issue 21): a router started with
``--admin-key-file`` / ``--api-keys-file`` (or ``admin_key_file`` in its config) accepts those
keys, and the keys never appear on its command line, which every local user reads in ``ps``;
``--admin-key`` still works but warns at start; a bad key file stops the start naming the key."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
LINE = re.compile(rb"kvrouter router listening on (http://127\.0\.0\.1:\d+)")
ADMIN = "admin-Zq8vX2kP0123456789"
CLIENT = "client-Lm4nB7cR9876543210"


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["PYTHONPATH"] = str(ROOT)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT),
    )  # fmt: skip


async def _serve(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await _spawn("serve", "--port", "0", *args)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    m = LINE.search(line)
    if m is None:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        raise AssertionError((line, err[-2000:]))
    return proc, m.group(1).decode()


async def _stop(proc: asyncio.subprocess.Process) -> bytes:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    return err


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_keys_from_files_are_accepted_and_stay_off_the_command_line(tmp_path: Path):
    admin, clients = tmp_path / "admin-key", tmp_path / "api-keys"
    admin.write_text(ADMIN + "\n")
    clients.write_text(f"# router clients\n{CLIENT}\n\nother-client\n")
    proc, url = await _serve("--admin-key-file", str(admin), "--api-keys-file", str(clients))
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # what ps shows
        assert str(admin).encode() in cmdline
        assert ADMIN.encode() not in cmdline and CLIENT.encode() not in cmdline
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            ok = await c.get(url + "/workers", headers=_bearer(ADMIN))
            assert ok.status_code == 200 and ok.json() == {"workers": []}
            for headers in ({}, _bearer("wrong"), _bearer(CLIENT)):
                r = await c.get(url + "/workers", headers=headers)
                assert r.status_code == 401, r.text
                assert r.json()["error"]["type"] == "authentication_error"
            # the client keys: /route needs one (then 503: no worker to route to)
            body = {"token_ids": [1, 2, 3]}
            assert (await c.post(url + "/route", json=body)).status_code == 401
            r = await c.post(url + "/route", json=body, headers=_bearer(CLIENT))
            assert r.status_code == 503, r.text
            r = await c.post(url + "/route", json=body, headers=_bearer("other-client"))
            assert r.status_code == 503, r.text
    finally:
        err = await _stop(proc)
    assert b"visible to every local user in ps" not in err
    assert ADMIN.encode() not in err and CLIENT.encode() not in err


async def test_admin_key_file_in_the_config(tmp_path: Path):
    admin = tmp_path / "admin-key"
    admin.write_text(ADMIN)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"admin_key_file: {admin}\n")
    proc, url = await _serve("--config", str(cfg))
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            assert (await c.get(url + "/workers", headers=_bearer(ADMIN))).status_code == 200
            assert (await c.get(url + "/workers")).status_code == 401
    finally:
        await _stop(proc)


async def test_admin_key_flag_still_works_but_warns(tmp_path: Path):
    proc, url = await _serve("--admin-key", ADMIN)
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            assert (await c.get(url + "/workers", headers=_bearer(ADMIN))).status_code == 200
    finally:
        err = await _stop(proc)
    assert b"--admin-key is visible to every local user in ps" in err
    assert b"KVROUTER_ADMIN_KEY" in err and b"--admin-key-file" in err
    assert ADMIN.encode() not in err  # the warning does not repeat the key


async def test_bad_key_files_stop_the_start_naming_key_and_path(tmp_path: Path):
    missing = tmp_path / "nope"
    proc = await _spawn("serve", "--port", "0", "--admin-key-file", str(missing))
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"admin_key_file: cannot read " + str(missing).encode() in err
    empty = tmp_path / "keys"
    empty.write_text("# nobody yet\n")
    proc = await _spawn("serve", "--port", "0", "--api-keys-file", str(empty))
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"api_keys_file: " + str(empty).encode() in err
    admin = tmp_path / "admin-key"
    admin.write_text(ADMIN)
    proc = await _spawn("serve", "--admin-key-file", str(admin), "--admin-key", "k")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"admin_key and admin_key_file are both set" in err
    assert ADMIN.encode() not in err
