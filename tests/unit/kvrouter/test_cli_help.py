"""What ``kvrouter ... --help`` tells a new user, from the real command: the version option, no
internal flag, the EPP and the ``KVROUTER_*`` environment, a help line for every option, and
no Sphinx markup."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvrouter import __version__

ROOT = Path(__file__).resolve().parents[3]


def _help(*words: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100")
    done = subprocess.run(
        [sys.executable, "-m", "kvrouter", *words, "--help"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def _options_without_help(text: str) -> list[str]:
    """The options argparse lists with nothing after them on their line or the next."""
    lines = text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-[-\w]+)(?: [^ ]+)?$", line)  # an option alone on its line
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m and not re.match(r"^ {20,}\S", nxt):  # its help would start the next line
            bare.append(m.group(1))
    return bare


def test_the_top_level_help_shows_the_version_option() -> None:
    text = _help()
    assert re.search(r"^  -V, --version  ", text, re.M), text
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for flag in ("--version", "-V"):
        out = subprocess.run(
            [sys.executable, "-m", "kvrouter", flag], capture_output=True, text=True, env=env
        )
        assert out.returncode == 0 and out.stdout == f"kvrouter {__version__}\n"


def test_serve_help_hides_fd_and_tells_of_the_epp_and_the_environment() -> None:
    text = _help("serve")
    assert "--fd" not in text and "--process " not in text and "--sync-dir" not in text
    assert "epp.port" in text and "KVROUTER_EPP__PORT" in text and ".[epp]" in text
    for name in ("KVROUTER_CONFIG", "KVROUTER_ADMIN_KEY", "KVROUTER_ADMIN_KEY_FILE"):
        assert re.search(rf"\b{name}\b", text), name
    assert "docs/configuration.md" in text
    assert "Exit status at start: 2 a setting, 4 a worker" in text
    assert _options_without_help(text) == []


def test_every_up_option_has_help() -> None:
    text = _help("up")
    assert "--admin-key-file" in text
    assert _options_without_help(text) == []


def test_replay_help_is_plain_text_with_live_flags_apart() -> None:
    text = _help("replay")
    assert "``" not in text and not re.search(r":\w+:`", text), text
    groups = dict(re.findall(r"^(\S[^\n]*):\n((?:  .*\n?)+)", text, re.M))
    live = groups["live mode (--mode live)"]
    general = groups["workload and output (both modes)"]
    for flag in ("--speedup", "--router-url", "--worker-url", "--max-inflight", "--cpu-blocks"):
        assert flag in live and flag not in general, flag
    for flag in ("--trace", "--policies", "--plots", "--json", "--no-progress"):
        assert flag in general and flag not in live, flag
    assert _options_without_help(text) == []


def test_route_and_workers_help_tell_where_the_keys_come_from() -> None:
    text = _help("route")
    assert "OPENAI_API_KEY" in text and "--api-key-file" in text and "/route" in text
    assert _options_without_help(text) == []
    text = _help("workers")
    assert "KVROUTER_ADMIN_KEY" in text and "--admin-key-file" in text
    assert _options_without_help(text) == []
    assert "route " in _help() and "workers " in _help()
