"""What the live benchmarks (``bench_epp``, ``bench_processes``, ``bench_sync_delay``) share
around their child processes: one temporary folder holding the children's output, the fast
upstream (``bench_epp.py --serve-upstream``), and the end of the run: every child stopped, and
the folder removed, or kept and named on stderr when the run failed.

    with Children("bench-epp") as kids:
        upstream, events = kids.upstream()
        router = kids.spawn("router", argv)
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: what ``bench_epp.py --serve-upstream`` prints once it serves
UPSTREAM_READY = re.compile(r"upstream (http://\S+) events=(\S+)")


class Children:
    """See the module docstring. ``stop`` cuts every wait on a child's line short."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self.log = open(self.tmp / "children.log", "w")  # noqa: SIM115 - closed at the end
        self.running: list[Any] = []
        self.stop = threading.Event()

    def spawn(self, label: str, argv: list[str], env: dict[str, str] | None = None) -> Any:
        """Start a child (:func:`kvrouter.up.spawn`); it is stopped at the end."""
        from kvrouter.up import spawn

        child = spawn(label, argv, log=self.log, env=env)
        self.running.append(child)
        return child

    def upstream(self) -> tuple[str, str]:
        """Start the fast upstream: its URL and its (silent) KV event endpoint."""
        argv = [sys.executable, str(ROOT / "benchmarks" / "bench_epp.py"), "--serve-upstream"]
        up = self.spawn("upstream", argv)
        url, events = up.wait_line(UPSTREAM_READY, 60, self.stop).groups()
        return str(url), str(events)

    def end(self, child: Any) -> None:
        """Stop one child now (a cell's router) instead of at the end."""
        from kvrouter.up import stop_children

        stop_children([child])
        self.running.remove(child)

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        from kvrouter.up import stop_children

        self.stop.set()
        stop_children(self.running)
        self.log.close()
        if kind is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            print(f"{self.name}: the children's output is in {self.tmp}", file=sys.stderr)
