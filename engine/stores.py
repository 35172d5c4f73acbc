"""Where EXTERNAL blocks live: a store shared by several engines (Redis, or a shared directory).

Values are opaque bytes under string keys; :mod:`engine.tiers` decides keys and value layout.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["DirStore", "ExternalStore", "RedisStore", "TierError", "atomic_write", "open_external"]


class TierError(RuntimeError):
    """A lower tier failed (I/O error, unreachable Redis, bad stored value)."""


class ExternalStore(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, data: bytes) -> None: ...
    def exists(self, keys: Sequence[str]) -> list[bool]: ...
    def delete(self, key: str) -> None: ...
    def close(self) -> None: ...


class DirStore:
    """A directory several engines share (one file per key, written by atomic rename)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierError(f"cannot use external directory {self.dir}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        try:
            return (self.dir / key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierError(f"external read {key}: {exc}") from exc

    def put(self, key: str, data: bytes) -> None:
        atomic_write(self.dir / key, data)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [(self.dir / k).exists() for k in keys]

    def delete(self, key: str) -> None:
        try:
            (self.dir / key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TierError(f"external delete {key}: {exc}") from exc

    def close(self) -> None:
        return None


class RedisStore:
    """A Redis server (``redis://HOST:PORT/DB``) holding one value per block."""

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        import redis

        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        try:
            self._r = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout
            )
            self._r.ping()
        except self._errors as exc:
            raise TierError(f"cannot reach the external Redis store {url}: {exc}") from exc

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as exc:
            raise TierError(f"external {what}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        data = self._call("get", self._r.get, key)
        return bytes(data) if data is not None else None

    def put(self, key: str, data: bytes) -> None:
        self._call("set", self._r.set, key, data)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return [bool(x) for x in self._call("exists", pipe.execute)]

    def delete(self, key: str) -> None:
        self._call("delete", self._r.delete, key)

    def close(self) -> None:
        self._r.close()


def open_external(url: str | None, directory: str | None) -> ExternalStore | None:
    if url and directory:
        raise TierError("give --external or --external-dir, not both")
    if url:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise TierError(f"--external must be a redis:// URL, got {url!r}")
        return RedisStore(url)
    if directory:
        return DirStore(directory)
    return None


def atomic_write(path: Path, data: bytes) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        raise TierError(f"cannot write {path}: {exc}") from exc
