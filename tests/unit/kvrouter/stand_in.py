"""A stand-in executable, shared by the kvrouter package's unit tests (test_gateway,
test_replay_epp)."""

from __future__ import annotations

from pathlib import Path


def stand_in_executable(path: Path) -> str:
    """An executable file at ``path`` that does nothing: a stand-in for the Envoy binary where a
    test only checks how it is found (nothing starts it)."""
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)
