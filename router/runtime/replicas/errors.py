"""Replica sync's exceptions: one tree, under :class:`ReplicaError`."""

from __future__ import annotations

__all__ = ["ReplicaError", "SyncBindError", "WarmStartError"]


class ReplicaError(Exception):
    """Replica sync or warm start could not do what was asked."""


class SyncBindError(ReplicaError):
    """``replicas.sync_bind`` could not be bound (in use, bad address): the start fails."""


class WarmStartError(ReplicaError):
    """One peer gave no usable index snapshot (the next is tried, then the cold start)."""
