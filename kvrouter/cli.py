"""The ``kvrouter`` command: ``serve`` (the router), ``engine`` (the bundled engine), ``up`` (both),
``replay`` (routing quality on a trace), ``route``, ``workers`` and ``check`` (a running router
asked).

Imports are lazy: ``kvrouter serve`` never loads the engine, ``kvrouter engine`` never loads the
router.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvrouter import __version__

__all__ = ["main"]

USAGE = """usage: kvrouter <command> [options]
       kvrouter --version

commands:
  serve    run the router            (kvrouter serve --help)
  engine   run a bundled engine      (kvrouter engine --help)
  up       run a router and N engines on this machine (kvrouter up --help)
  replay   replay a trace through every routing policy (kvrouter replay --help)
  route    where a running router would send a request, and why (kvrouter route --help)
  workers  a running router's workers and their event streams (kvrouter workers --help)
  check    are a running router's workers seen as they are: events, capacity, tokenizer
           and block size agreement (kvrouter check --help)

options:
  -h, --help     show this help and exit
  -V, --version  print kvrouter's version and exit
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] in ("-V", "--version", "version"):
        print(f"kvrouter {__version__}")
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "serve":
        from router.cli import main as serve_main

        return serve_main(rest)
    if cmd == "engine":
        from engine.cli import main as engine_main

        return engine_main(rest)
    if cmd == "up":
        from kvrouter.up import main as up_main

        return up_main(rest)
    if cmd == "replay":
        from kvrouter.replay.cli import main as replay_main

        return replay_main(rest)
    if cmd == "check":
        from kvrouter.check import main as check_main

        return check_main(rest)
    if cmd in ("route", "workers"):
        from kvrouter.client import main as client_main

        return client_main(cmd, rest)
    print(f"kvrouter: unknown command {cmd!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2
