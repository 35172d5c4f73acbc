"""Model runners and the factory the engine builds them with.

``sim`` lives here; ``torch`` lives in ``engine.torch_runner`` (which must export a
``TorchRunner(config: RunnerConfig)`` subclass of :class:`ModelRunner`) and is imported only when
asked for, so the sim engine never imports torch.
"""

from __future__ import annotations

from engine.runner.base import (
    DoneTransfer,
    ModelRunner,
    RunnerConfig,
    RunnerError,
    SamplingParams,
    ScheduledSeq,
    StepOutput,
    Transfer,
)

__all__ = [
    "RUNNERS",
    "DoneTransfer",
    "ModelRunner",
    "RunnerConfig",
    "RunnerError",
    "SamplingParams",
    "ScheduledSeq",
    "StepOutput",
    "Transfer",
    "make_runner",
]

RUNNERS = ("sim", "torch")


def make_runner(name: str, config: RunnerConfig) -> ModelRunner:
    """Build the runner called ``name`` (``sim`` or ``torch``) from ``config``."""
    if name == "sim":
        from engine.runner.sim import SimRunner

        return SimRunner(config)
    if name == "torch":
        try:
            from engine.torch_runner import TorchRunner
        except ImportError as exc:
            raise RunnerError(
                f"the torch runner is not available ({exc}); in the kvrouter checkout: pip install -e '.[torch]'"
            ) from exc
        return TorchRunner(config)
    raise RunnerError(f"unknown runner {name!r}; choose one of {', '.join(RUNNERS)}")
