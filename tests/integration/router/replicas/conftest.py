"""The replica tests' shared fixtures (their helpers are modules beside them)."""

from snapshot_peer import snapshot_server

__all__ = ["snapshot_server"]
