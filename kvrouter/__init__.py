"""kvrouter: a KV-aware router for LLM inference fleets (the ``kvrouter`` command lives here).

Subcommands dispatch lazily to their packages — ``serve`` → :mod:`router`, ``engine`` →
:mod:`engine`, ``up`` → :mod:`kvrouter.up` — so the router never imports the engine or the other
way round.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
