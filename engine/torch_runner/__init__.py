"""The ``torch`` runner: a Llama-style decoder (Llama, Qwen2) over the engine's paged KV pool.

``engine.runner.make_runner("torch", ...)`` imports :class:`TorchRunner` from here. Attribute access
is lazy so ``engine.torch_runner.config`` stays importable (and cheap) without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runner import TorchRunner

__all__ = ["TorchRunner"]


def __getattr__(name: str) -> Any:
    if name == "TorchRunner":
        from .runner import TorchRunner

        return TorchRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
