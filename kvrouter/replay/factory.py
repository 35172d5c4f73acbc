"""The virtual-time policies by name: :data:`VIRTUAL_POLICIES` (what ``kvrouter replay
--policies`` accepts in virtual time) and :func:`make_policy`, which builds one for a run.

The policies themselves are :mod:`kvrouter.replay.policies` (the base and most of them),
:mod:`kvrouter.replay.smg` and :mod:`kvrouter.replay.replicas` (policy ``kvrouter`` through
several routers); they build on the base and never on this module, so the imports run one way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.engine import LLMEngine
from kvrouter.replay.pd_policy import KvrouterPdPolicy
from kvrouter.replay.policies import (
    CacheAwarePolicy,
    KvrouterEarlyHeadPolicy,
    KvrouterPolicy,
    LeastLoadPolicy,
    OraclePolicy,
    Policy,
    RandomPolicy,
    RoundRobinPolicy,
)
from kvrouter.replay.replicas import ReplicatedKvrouterPolicy, RouterReplicas
from kvrouter.replay.smg import SmgPolicy
from router.settings import Settings

__all__ = ["VIRTUAL_POLICIES", "make_policy"]

VIRTUAL_POLICIES = (
    "random",
    "round_robin",
    "least_load",
    "kvrouter",
    "kvrouter-early-head",
    "cache_aware",
    "smg",
    "smg_dark",
    "oracle",
)


def make_policy(
    name: str,
    engines: Sequence[LLMEngine],
    *,
    seed: int,
    settings: Settings,
    clock: Callable[[], float],
    replicas: RouterReplicas | None = None,
    no_events: int = 0,
    roles: Sequence[str] = (),
) -> Policy:
    """``replicas``: policy ``kvrouter`` through several routers (:mod:`kvrouter.replay.replicas`);
    ``no_events``: for one router, its first that many workers publish no KV events; ``roles``:
    a prefill/decode fleet's roles, which only policy ``kvrouter`` places on (one router, the
    settings' ``pd.mode``: :mod:`kvrouter.replay.pd_policy`)."""
    if roles:
        if name != "kvrouter":
            raise ValueError(f"a prefill/decode fleet runs policy kvrouter only, not {name!r}")
        return KvrouterPdPolicy(engines, settings, clock, roles)
    if name == "random":
        return RandomPolicy(engines, seed)
    if name == "round_robin":
        return RoundRobinPolicy(engines)
    if name == "least_load":
        return LeastLoadPolicy(engines)
    if name == "kvrouter":
        if replicas is not None and replicas.count > 1:
            return ReplicatedKvrouterPolicy(engines, settings, clock, replicas, seed)
        return KvrouterPolicy(engines, settings, clock, no_events)
    if name == "kvrouter-early-head":
        return KvrouterEarlyHeadPolicy(engines, settings, clock)
    if name == "cache_aware":
        return CacheAwarePolicy(engines)
    if name in ("smg", "smg_dark"):
        return SmgPolicy(engines, seed, reports=name == "smg")
    if name == "oracle":
        return OraclePolicy(engines)
    raise ValueError(f"unknown virtual-time policy {name!r} (known: {', '.join(VIRTUAL_POLICIES)})")
