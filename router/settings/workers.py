"""One worker entry of the settings (``workers:`` in YAML, ``--worker`` on the command line,
``POST /workers``): :class:`WorkerConfig` and the ``--worker`` spec's parser."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from router.errors import ConfigError
from router.errors import config_check as _check
from router.settings.pd import ROLES

__all__ = ["EVENTS_NONE", "WorkerConfig", "parse_worker_spec"]

_WORKER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: ``events_endpoint`` of a worker that publishes no KV events: the router keeps an approximate
#: tree of what it sent there (docs/architecture.md §3)
EVENTS_NONE = "none"


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One inference worker: its OpenAI URL, its KV event endpoints and its data-parallel ranks."""

    id: str
    url: str
    #: None: read from the worker's GET /kv_event_sources; "none": it publishes no events
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    dp_ranks: int = 1
    pool: str | None = None
    model: str = ""
    #: prefill, decode or both (a whole request); docs/architecture.md §10
    role: str = "both"
    #: SGLang PD: the prefill worker's bootstrap port (its host is the URL's)
    bootstrap_port: int | None = None
    #: GPU KV blocks per rank, when its /metrics does not say (or says wrong): the capacity
    #: that bounds its index entries (its approximate tree's, without events) and scoring's
    kv_blocks: int | None = None

    def __post_init__(self) -> None:
        # ids reach response headers (x-kvrouter-worker), metric labels and URLs: a strict charset
        ok = _WORKER_ID.fullmatch(self.id) is not None
        _check(ok, "id", "must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        _check(self.url.startswith(("http://", "https://")), "url", "must be an http(s) URL")
        for key in ("events_endpoint", "replay_endpoint"):
            ep = getattr(self, key)
            if ep is not None and not (key == "events_endpoint" and ep == EVENTS_NONE):
                zmq_ok = ep.startswith(("tcp://", "ipc://", "inproc://"))
                _check(zmq_ok, key, "must be a ZMQ endpoint (tcp://host:port) or 'none'")
        ok = not (self.approximate and self.replay_endpoint)
        _check(ok, "replay_endpoint", "needs events (events_endpoint is 'none')")
        _check(1 <= self.dp_ranks <= 1024, "dp_ranks", "must be between 1 and 1024")
        _check(self.role in ROLES, "role", f"must be one of {', '.join(ROLES)}")
        bp = self.bootstrap_port
        _check(bp is None or 1 <= bp <= 65535, "bootstrap_port", "must be between 1 and 65535")
        _check(self.kv_blocks is None or self.kv_blocks >= 1, "kv_blocks", "must be >= 1")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")

    @property
    def approximate(self) -> bool:
        """It publishes no KV events: its index entries are what the router sent there."""
        return self.events_endpoint == EVENTS_NONE


def parse_worker_spec(spec: str) -> dict[str, Any]:
    """``id=w0,url=http://h:8001,events=tcp://h:5557|none[,replay=...][,dp=2][,pool=P][,model=M]
    [,role=prefill|decode|both][,bootstrap=PORT][,kv_blocks=N]``."""
    names = {
        "id": "id",
        "url": "url",
        "events": "events_endpoint",
        "replay": "replay_endpoint",
        "dp": "dp_ranks",
        "pool": "pool",
        "model": "model",
        "role": "role",
        "bootstrap": "bootstrap_port",
        "kv_blocks": "kv_blocks",
    }
    out: dict[str, Any] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in names:
            raise ConfigError(
                f"invalid --worker {spec!r}: unknown item {part!r} (expected id=, url=, events=, "
                "replay=, dp=, pool=, model=, role=, bootstrap=, kv_blocks=)"
            )
        if key in ("dp", "bootstrap", "kv_blocks"):
            try:
                out[names[key]] = int(value)
            except ValueError as e:
                raise ConfigError(f"invalid --worker {spec!r}: {key} must be an integer") from e
        else:
            out[names[key]] = value.strip()
    for required in ("id", "url"):
        if names[required] not in out:
            raise ConfigError(f"invalid --worker {spec!r}: missing {required}=")
    return out
