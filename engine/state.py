"""What a running engine server holds: :class:`EngineState` (``app.state.kv``) and its accessor.

It owns the per-app record that :mod:`engine.server` builds in its lifespan (settings, the async
engine, tokenizer, metrics, publisher, served model name) and :func:`engine_state`, which every
route module (:mod:`engine.server`, :mod:`engine.sglang_compat`) uses to read it off a request.
It sits below both so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from engine.async_engine import AsyncEngine
from engine.config import ServerSettings
from engine.metrics import EngineMetrics
from engine.pd.legs import PdNode
from engine.publisher import EventPublisher
from engine.tokenizer import Tokenizer

__all__ = ["EngineState", "engine_state"]


@dataclass
class EngineState:
    settings: ServerSettings
    engine: AsyncEngine
    tokenizer: Tokenizer
    metrics: EngineMetrics
    publisher: EventPublisher | None
    model: str
    pd: PdNode

    @property
    def events_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher else None


def engine_state(request: Request) -> EngineState:
    """The :class:`EngineState` of the app serving ``request``."""
    st: EngineState = request.app.state.kv
    return st
