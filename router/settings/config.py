"""Router settings: one YAML file, overridden by ``KVROUTER_*`` environment variables, overridden by
command-line flags. Every key is documented in ``configs/router.example.yaml``.

Validation happens once, at start: an unknown key, a wrong type or an out-of-range value raises
:class:`router.errors.ConfigError` whose message names the key (``scoring.overlap_weight``,
``workers[1].url``...).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import yaml

from router.errors import ConfigError
from router.errors import config_check as _check
from router.settings.agreement import AgreementSettings
from router.settings.epp import EppSettings
from router.settings.k8s import KubernetesSettings
from router.settings.keyfiles import read_key_files
from router.settings.pd import PdSettings
from router.settings.replicas import ReplicaSettings
from router.settings.scoring import ScoringSettings
from router.settings.workers import WorkerConfig, parse_worker_spec

__all__ = [
    "HealthSettings",
    "IndexSettings",
    "ProxySettings",
    "RouteSettings",
    "ServerSettings",
    "Settings",
    "SnapshotSettings",
    "SubscriberSettings",
    "TracingSettings",
    "WorkerConfig",
    "load_settings",
    "parse_worker_spec",
]


ENV_PREFIX = "KVROUTER_"


class ProxySettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    retries: int = 2
    max_inflight: int = 1024
    max_body_bytes: int = 8 * 1024 * 1024
    max_response_bytes: int = 64 * 1024 * 1024
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 10.0
    max_connections: int = 1000
    keepalive_s: float = 2.0
    ca_file: str | None = None

    def __post_init__(self) -> None:
        _check(0 <= self.retries <= 16, "retries", "must be between 0 and 16")
        _check(self.max_inflight >= 1, "max_inflight", "must be >= 1")
        _check(self.max_body_bytes >= 1024, "max_body_bytes", "must be >= 1024")
        _check(self.max_response_bytes >= 1024, "max_response_bytes", "must be >= 1024")
        _check(self.max_connections >= 1, "max_connections", "must be >= 1")
        _check(self.keepalive_s >= 0, "keepalive_s", "must be >= 0")
        ok = self.ca_file is None or os.path.isfile(self.ca_file)
        _check(ok, "ca_file", "must be a readable PEM file")
        for k in ("connect_timeout_s", "read_timeout_s", "write_timeout_s", "pool_timeout_s"):
            _check(getattr(self, k) > 0, k, "must be > 0")


class ServerSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    http: str = "h11"
    max_connections: int = 2048
    keep_alive_timeout_s: float = 5.0
    head_timeout_s: float = 10.0
    max_header_bytes: int = 65536
    body_timeout_s: float = 30.0
    drain_grace_s: float = 30.0
    docs: bool = True
    processes: int = 1  # replica processes on one port (router.edge.processes)
    metrics_port: int | None = None  # with processes > 1: process i also serves on this + i

    def __post_init__(self) -> None:
        _check(self.http in ("h11", "httptools"), "http", "must be h11 or httptools")
        _check(1 <= self.processes <= 256, "processes", "must be between 1 and 256")
        ok = self.metrics_port is None or 0 <= self.metrics_port <= 65535 - self.processes
        _check(ok, "metrics_port", "must be between 0 and 65535 - processes")
        _check(self.max_connections >= 1, "max_connections", "must be >= 1")
        _check(self.max_header_bytes >= 1024, "max_header_bytes", "must be >= 1024")
        for k in ("keep_alive_timeout_s", "head_timeout_s", "body_timeout_s"):
            _check(getattr(self, k) > 0, k, "must be > 0")
        _check(self.drain_grace_s >= 0, "drain_grace_s", "must be >= 0")


class HealthSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    interval_s: float = 2.0
    timeout_s: float = 1.0
    unhealthy_after: int = 2
    path: str = "/health"
    scrape_metrics: bool = False
    stale_events_s: float = 30.0

    def __post_init__(self) -> None:
        _check(self.interval_s > 0, "interval_s", "must be > 0")
        _check(self.timeout_s > 0, "timeout_s", "must be > 0")
        _check(self.unhealthy_after >= 1, "unhealthy_after", "must be >= 1")
        _check(self.path.startswith("/"), "path", "must start with '/'")
        _check(self.stale_events_s > 0, "stale_events_s", "must be > 0")


class RouteSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    account_ttl_s: float = 300.0
    max_accounted: int = 100_000

    def __post_init__(self) -> None:
        _check(self.account_ttl_s > 0, "account_ttl_s", "must be > 0")
        _check(self.max_accounted >= 1, "max_accounted", "must be >= 1")


class SubscriberSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    replay_timeout_s: float = 2.0
    max_message_bytes: int = 64 << 20
    batch_window_ms: float = 10.0

    def __post_init__(self) -> None:
        _check(self.replay_timeout_s > 0, "replay_timeout_s", "must be > 0")
        _check(self.max_message_bytes > 0, "max_message_bytes", "must be > 0")
        _check(0 <= self.batch_window_ms <= 1000, "batch_window_ms", "must be in [0, 1000]")


class IndexSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The index's memory bounds besides ``max_index_entries`` (docs/architecture.md §3)."""

    max_rank_entries: int = 1_000_000
    capacity_margin: float = 1.25
    memory_fraction: float = 0.25
    capacity_refresh_s: float = 60.0

    def __post_init__(self) -> None:
        _check(self.max_rank_entries >= 0, "max_rank_entries", "must be >= 0")
        _check(self.capacity_margin >= 1, "capacity_margin", "must be >= 1")
        _check(0 < self.memory_fraction <= 1, "memory_fraction", "must be in (0, 1]")
        _check(self.capacity_refresh_s > 0, "capacity_refresh_s", "must be > 0")


class SnapshotSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    path: str | None = None
    interval_s: float = 60.0

    def __post_init__(self) -> None:
        _check(self.interval_s > 0, "interval_s", "must be > 0")


class TracingSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    otlp_endpoint: str | None = None
    service_name: str = "kvrouter"
    sample_ratio: float = 1.0
    batch_delay_s: float = 5.0
    export_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        ok = self.otlp_endpoint is None or self.otlp_endpoint.startswith(("http://", "https://"))
        _check(ok, "otlp_endpoint", "must be an http:// or https:// URL")
        _check(0 <= self.sample_ratio <= 1, "sample_ratio", "must be between 0 and 1")
        _check(self.batch_delay_s > 0, "batch_delay_s", "must be > 0")
        _check(self.export_timeout_s > 0, "export_timeout_s", "must be > 0")


class Settings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host: str = "127.0.0.1"
    port: int = 8000
    block_size: int = 16
    max_index_entries: int | None = None
    admin_key: str | None = None
    admin_key_file: str | None = None  # read at start into admin_key (router.settings.keyfiles)
    admin_open: bool = False
    api_keys: list[str] = msgspec.field(default_factory=list)
    api_keys_file: str | None = None  # read at start into api_keys
    tokenizer: str = "byte"
    log_level: str = "info"
    log_format: str = "text"
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    proxy: ProxySettings = msgspec.field(default_factory=ProxySettings)
    health: HealthSettings = msgspec.field(default_factory=HealthSettings)
    scoring: ScoringSettings = msgspec.field(default_factory=ScoringSettings)
    route: RouteSettings = msgspec.field(default_factory=RouteSettings)
    subscriber: SubscriberSettings = msgspec.field(default_factory=SubscriberSettings)
    index: IndexSettings = msgspec.field(default_factory=IndexSettings)
    snapshot: SnapshotSettings = msgspec.field(default_factory=SnapshotSettings)
    kubernetes: KubernetesSettings = msgspec.field(default_factory=KubernetesSettings)
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)
    replicas: ReplicaSettings = msgspec.field(default_factory=ReplicaSettings)
    epp: EppSettings = msgspec.field(default_factory=EppSettings)
    pd: PdSettings = msgspec.field(default_factory=PdSettings)
    agreement: AgreementSettings = msgspec.field(default_factory=AgreementSettings)
    workers: list[WorkerConfig] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "must be between 0 and 65535")
        _check(self.log_format in ("text", "json"), "log_format", "must be text or json")
        _check(1 <= self.block_size <= 4096, "block_size", "must be between 1 and 4096")
        _check((self.max_index_entries or 0) >= 0, "max_index_entries", "must be >= 0")
        _check(
            self.tokenizer in ("byte", "worker") or self.tokenizer.startswith("hf:"),
            "tokenizer",
            "must be 'byte', 'worker' or 'hf:<dir>'",
        )
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        _check(self.log_level in levels, "log_level", f"must be one of {'/'.join(levels)}")
        ok = self.server.processes == 1 or self.replicas.sync_bind is None
        _check(ok, "replicas.sync_bind", "is for one process: server.processes syncs over ipc://")
        seen: set[str] = set()
        for i, w in enumerate(self.workers):
            _check(w.id not in seen, f"workers[{i}].id", f"duplicates worker id {w.id!r}")
            seen.add(w.id)


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_NAMED = re.compile(r"^`(?P<key>[^`]*)` (?P<msg>.*)$", re.S)


def describe_validation_error(e: msgspec.ValidationError) -> tuple[str, str]:
    """``(dotted key, problem)`` from msgspec's ``"... - at `$.a.b[0]`"`` message."""
    m = _AT.match(str(e))
    msg, path = (m.group("msg"), m.group("path") or "") if m else (str(e), "")
    for pattern, problem in ((_UNKNOWN, "unknown key"), (_NAMED, None)):
        k = pattern.match(msg)
        if k:
            path = f"{path}.{k.group('key')}" if path else k.group("key")
            msg = problem or k.group("msg")
            break
    missing = re.match(r"^Object missing required field `(?P<key>[^`]*)`$", msg)
    if missing:
        path = f"{path}.{missing.group('key')}" if path else missing.group("key")
        msg = "is required"
    return path or "<top level>", msg[:1].lower() + msg[1:]


def _convert(raw: Mapping[str, Any]) -> Settings:
    try:
        return msgspec.convert(raw, Settings)
    except msgspec.ValidationError as e:
        key, problem = describe_validation_error(e)
        raise ConfigError(f"invalid config: {key}: {problem}") from e


_STRING_KEYS = (
    "admin_key", "admin_key_file", "api_keys_file", "host", "tokenizer", "tls_cert", "tls_key"
)  # fmt: skip


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVROUTER_PORT=9000``, ``KVROUTER_SCORING__OVERLAP_WEIGHT=2``: values are YAML scalars."""
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "KVROUTER_CONFIG":
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"invalid config: env {name} is not a YAML value: {e}") from e
        if path[-1] in _STRING_KEYS and parsed is not None:
            parsed = str(value)
        d = out
        for p in path[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ConfigError(f"invalid config: env {name} conflicts with another variable")
        d[path[-1]] = parsed
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    worker_specs: Sequence[str] = (),
) -> Settings:
    """YAML file (if any), then env, then explicit overrides and ``--worker`` specs.

    A ``--worker`` whose id matches a configured worker replaces it; others are appended.
    ``admin_key_file`` and ``api_keys_file`` are read here, at start, into ``admin_key`` and
    ``api_keys`` (:mod:`router.settings.keyfiles`).
    """
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    if path is None and env.get("KVROUTER_CONFIG"):
        path = env["KVROUTER_CONFIG"]
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"invalid config {path}: not YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"invalid config {path}: the top level must be a mapping")
        raw = loaded
    raw = _merge(raw, _env_overrides(env))
    if overrides:
        raw = _merge(raw, {k: v for k, v in overrides.items() if v is not None})
    if worker_specs:
        workers = list(raw.get("workers") or [])
        for spec in worker_specs:
            w = parse_worker_spec(spec)
            workers = [x for x in workers if not (isinstance(x, dict) and x.get("id") == w["id"])]
            workers.append(w)
        raw["workers"] = workers
    return _convert(read_key_files(raw))
