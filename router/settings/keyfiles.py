"""Keys read from files: ``admin_key_file`` and ``api_keys_file`` (issue 21).

A key given as ``--admin-key`` is on the process's command line, which every local user reads in
``ps``; one in ``KVROUTER_ADMIN_KEY`` is in its environment. A file — in Kubernetes a Secret
mounted as a volume — keeps the key out of both (and out of the config file). The files are read
once, at start, by :func:`router.settings.load_settings`, which puts what they hold into
``admin_key`` / ``api_keys``: the rest of the router reads only those.

- ``admin_key_file``: the admin key is the file's content, stripped (a trailing newline is
  normal); one line.
- ``api_keys_file``: the client keys, one a line; blank lines and lines starting with ``#`` are
  skipped.

Each is mutually exclusive with the key it replaces, wherever either was set (config file,
environment, flags). A missing, unreadable or empty file stops the router at start with a
:class:`router.errors.ConfigError` naming the key and the path, never the content.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.errors import ConfigError

__all__ = ["read_key_files"]


def read_key_files(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` (the merged config, before validation) with ``admin_key`` and ``api_keys`` read
    from the files ``admin_key_file`` and ``api_keys_file`` name, where they do."""
    out = dict(raw)
    path = _path(raw, "admin_key_file")
    if path is not None:
        if raw.get("admin_key"):
            raise ConfigError(
                "invalid config: admin_key and admin_key_file are both set: give the admin key "
                "one way (admin_key_file, a mounted Secret, keeps it out of ps and the environment)"
            )
        lines = _read(path, "admin_key_file").strip().splitlines()
        if not lines:
            raise ConfigError(f"invalid config: admin_key_file: {path} is empty")
        if len(lines) > 1:
            raise ConfigError(
                f"invalid config: admin_key_file: {path} holds {len(lines)} lines: the admin key "
                "is one line"
            )
        out["admin_key"] = lines[0]
    path = _path(raw, "api_keys_file")
    if path is not None:
        if raw.get("api_keys"):
            raise ConfigError(
                "invalid config: api_keys and api_keys_file are both set: give the client keys "
                "one way"
            )
        keys = [
            line.strip()
            for line in _read(path, "api_keys_file").splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if not keys:
            raise ConfigError(
                f"invalid config: api_keys_file: {path} holds no key (one a line; blank lines "
                "and # comments are skipped)"
            )
        out["api_keys"] = keys
    return out


def _path(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"invalid config: {key}: expected the path of a file")
    return value


def _read(path: str, key: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as e:  # (the reason, never anything read)
        raise ConfigError(
            f"invalid config: {key}: cannot read {path}: {e.strerror or type(e).__name__}"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"invalid config: {key}: {path} is not UTF-8 text") from None
