"""``kvrouter check`` against real workers: two bundled engines behind a router, as ``kvrouter up``
starts them (subprocesses on free loopback ports), one configured as the router is and one whose
tokenizer differs (a word-level ``tokenizer.json``; the router tokenizes bytes). The check passes
the first, names the second with the likely cause, and exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvrouter.check import _WORDS
from kvrouter.up import (
    ENGINE_READY,
    ROUTER_READY,
    Child,
    engine_argv,
    router_argv,
    spawn,
    stop_children,
    worker_spec,
)
from tests.waiting import poll

ROOT = Path(__file__).resolve().parents[2]
KEY = "check-admin"

pytestmark = pytest.mark.slow


def word_tokenizer(out: Path) -> Path:
    """A word-level tokenizer that knows the probe's words (numbers are one unknown token each):
    a worker tokenizing so counts about a sixth of the router's byte tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[str]:
    stop = threading.Event()
    log = open(tmp_path / "fleet.log", "w")  # noqa: SIM115 - closed in the finally below
    children: list[Child] = []
    try:
        words = str(word_tokenizer(tmp_path / "words"))
        specs = []
        for name, extra in (("good", []), ("odd", ["--tokenizer", words])):
            child = spawn(name, engine_argv(1, speedup=10, extra=extra), log)
            children.append(child)
            specs.append(worker_spec(name, child.wait_line(ENGINE_READY, 60, stop)))
        router = spawn("router", router_argv(specs), log, env={"KVROUTER_ADMIN_KEY": KEY})
        children.append(router)
        url = router.wait_line(ROUTER_READY, 60, stop).group(1)
        poll(lambda: httpx.get(url + "/ready", timeout=2).status_code == 200, 30, "ready")

        def capacities_known() -> bool:  # (each worker's first scrape comes in its own time)
            got = httpx.get(url + "/workers", headers={"authorization": f"Bearer {KEY}"})
            return all(r["capacity"] for w in got.json()["workers"] for r in w["ranks"])

        poll(capacities_known, 30, "every worker's KV capacity")
        yield url
    finally:
        stop.set()
        stop_children(children)
        log.close()


def kvrouter_check(*args: str, key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVROUTER_", "OPENAI_"))}
    env["PYTHONPATH"] = str(ROOT)
    if key is not None:
        env["KVROUTER_ADMIN_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "kvrouter", "check", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip


def test_check_passes_the_matching_worker_and_names_the_other_tokenizer(fleet: str) -> None:
    done = kvrouter_check("--router", fleet)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, (done.stdout, done.stderr)
    good = [x for x in lines if x.startswith("ok good: ")]
    assert len(good) == 1, lines
    assert "events flowing" in good[0] and "capacity 2048 blocks" in good[0]
    agreed = good[0].split("prefix agreement ")[1].split()[0]
    got, expected = map(int, agreed.split("/"))
    assert got == expected > 20  # every reusable block of the probe, reported as predicted

    odd = [x for x in lines if x.startswith("PROBLEM odd: ")]
    assert len(odd) == 1, lines
    assert "where the index predicts 0" in odd[0] and "tokenizer" in odd[0]
    reported = int(odd[0].split("reports ")[1].split()[0])
    assert reported > 0  # the worker reuses its own tokens' blocks the router never matched
    # what is fine about it comes first, on its own line
    assert lines.index("ok odd: events flowing, capacity 2048 blocks") == lines.index(odd[0]) - 1

    # only the good one: all fine, exit 0
    done = kvrouter_check("--router", fleet, "good")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.startswith("ok good: events flowing, capacity 2048 blocks, prefix ")


def test_check_without_the_admin_key_is_one_line(fleet: str) -> None:
    done = kvrouter_check("--router", fleet, key=None)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "/workers: 401" in done.stderr
    assert "KVROUTER_ADMIN_KEY or --admin-key-file" in done.stderr
    body = json.dumps({"prompt": "x"})  # (and a pin without the key: refused by the router)
    got = httpx.post(fleet + "/v1/completions", content=body, headers={"x-kvrouter-worker": "good"})
    assert got.status_code == 401
