"""``kvrouter serve --processes 2`` as a real process tree: every process's log lines say which
process wrote them (``[p1]``; ``"process": 1`` in JSON), uvicorn's own lines included, as they
share one stderr; the supervising parent's lines carry no tag."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROCESS_LINE = re.compile(rb"kvrouter router process (\d+) \(pid \d+\) listening on ")


async def serve_two(tmp_path: Path, *args: str) -> list[str]:
    """The stderr lines of a two-process router, started until both serve, then stopped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env["PYTHONPATH"] = str(ROOT)
    log = tmp_path / "router.log"
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrouter", "serve", "--processes", "2", "--port", "0", *args,
            stdout=asyncio.subprocess.PIPE, stderr=err, cwd=str(ROOT), env=env,
        )  # fmt: skip
    try:
        serving: set[int] = set()
        assert proc.stdout is not None
        while len(serving) < 2:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, log.read_text()[-3000:]
            m = PROCESS_LINE.search(line)
            if m:
                serving.add(int(m.group(1)))
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 60)
    return log.read_text().splitlines()


@pytest.mark.slow
async def test_each_process_tags_its_log_lines(tmp_path):
    lines = await serve_two(tmp_path)
    for i in (0, 1):
        mine = [x for x in lines if f" [p{i}] " in x]
        assert any(f" [p{i}] kvrouter.router: ready " in x for x in mine), lines
        assert any(f" [p{i}] uvicorn.error: " in x for x in mine), lines  # uvicorn's too
    # the parent's own lines are untagged; no child line is
    untagged = [x for x in lines if re.match(r"^\S+ \S+ (INFO|WARNING|ERROR) [^\[]", x)]
    assert untagged and all(" kvrouter.processes: " in x for x in untagged), untagged


@pytest.mark.slow
async def test_each_process_tags_its_json_log_lines(tmp_path):
    lines = await serve_two(tmp_path, "--log-format", "json")
    records = [json.loads(x) for x in lines if x.startswith("{")]
    assert len(records) == len([x for x in lines if x.strip()]), lines  # JSON, every line
    for i in (0, 1):
        mine = [r for r in records if r.get("process") == i]
        assert any(r["logger"] == "kvrouter.router" for r in mine), records
        assert any(r["logger"].startswith("uvicorn") for r in mine), records
