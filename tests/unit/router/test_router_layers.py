"""The placement core loads no I/O library, in a fresh interpreter (a real subprocess): what
``import-linter`` holds statically (pyproject.toml), checked at run time too, where an import
hidden in a function or a package ``__init__`` would show."""

from __future__ import annotations

import json
import subprocess
import sys

IO_LIBRARIES = (
    "zmq",
    "aiohttp",
    "uvicorn",
    "starlette",
    "fastapi",
    "httpx",
    "grpc",
    "prometheus_client",
    "redis",
)

PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {libs!r})))
"""


def loaded_by(module: str) -> list[str]:
    code = PROBE.format(module=module, libs=set(IO_LIBRARIES))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return list(json.loads(out.stdout))


def test_the_placement_core_and_what_the_replay_builds_load_no_io_library() -> None:
    for module in ("router.placement", "router.fleet.registry", "indexer.index"):
        assert loaded_by(module) == [], module


def test_the_probe_sees_an_io_library_when_one_is_loaded() -> None:
    assert "aiohttp" in loaded_by("router.fleet.upstream")
