"""Settings of the Envoy ext_proc endpoint picker (``epp:``, :mod:`router.edge.epp`); part of
:class:`router.settings.Settings`, kept here so each module stays small."""

from __future__ import annotations

import os

import msgspec

from router.errors import config_check as _check

__all__ = ["EppSettings"]


class EppSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The Envoy ext_proc endpoint picker (:mod:`router.edge.epp`): off while ``port`` is None."""

    port: int | None = None
    host: str = "127.0.0.1"
    #: the picker's certificate and key (PEM files); neither: TLS with a self-signed
    #: certificate made at each start (router.edge.epp.tls)
    tls_cert: str | None = None
    tls_key: str | None = None
    #: serve gRPC without TLS: only on a trusted network (a warning at start says so)
    plaintext: bool = False
    max_streams: int = 4096
    stream_timeout_s: float = 30.0
    #: after the pick, the longest silence between two messages of the answer's phase (its
    #: head, a chunk, its end; with the answer's body off the picker: the whole answer)
    response_timeout_s: float = 600.0
    fallbacks: int = 0
    shutdown_grace_s: float = 5.0

    def __post_init__(self) -> None:
        ok = self.port is None or 0 <= self.port <= 65535
        _check(ok, "port", "must be between 0 and 65535 (or null: off)")
        _check((self.tls_cert is None) == (self.tls_key is None), "tls_cert", "needs tls_key")
        ok = not (self.plaintext and self.tls_cert is not None)
        _check(ok, "plaintext", "contradicts tls_cert/tls_key (set one or the other)")
        for k in ("tls_cert", "tls_key"):
            path = getattr(self, k)
            _check(path is None or os.path.isfile(path), k, "must be a readable PEM file")
        _check(self.max_streams >= 1, "max_streams", "must be >= 1")
        _check(self.stream_timeout_s > 0, "stream_timeout_s", "must be > 0")
        _check(self.response_timeout_s > 0, "response_timeout_s", "must be > 0")
        _check(0 <= self.fallbacks <= 16, "fallbacks", "must be between 0 and 16")
        _check(self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0")
