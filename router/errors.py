"""The router's exception hierarchy and its JSON error body ``{"error": {"message", "type"}}``:
the one home of both, at the bottom of the router's layers (no HTTP library here; the edge wraps
the body in a response, :func:`router.edge.bodies.error_response`).

Handlers raise these; the edge turns every one into the documented status code. Lower-level errors
(msgspec, httpx, tokenizers) are translated with ``raise ... from`` where they cross into the router.
"""

from __future__ import annotations

import errno
import secrets
from collections.abc import Sequence

import msgspec

__all__ = [
    "BadGateway",
    "BadRequest",
    "ConfigError",
    "Conflict",
    "ErrorBody",
    "ErrorDetail",
    "Forbidden",
    "GatewayTimeout",
    "ListenError",
    "MethodNotAllowed",
    "NoHealthyWorker",
    "NotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "RouterError",
    "StartupError",
    "TokenizeError",
    "TooManyRequests",
    "Unauthorized",
    "UnprocessableEntity",
    "WorkerUnusable",
    "config_check",
    "error_json",
    "require_bearer",
]


def config_check(cond: bool, key: str, msg: str) -> None:
    # msgspec turns a ValueError raised in __post_init__ into a ValidationError carrying the path
    # of the struct; naming the field here completes it ("... - at `$.scoring`").
    if not cond:
        raise ValueError(f"`{key}` {msg}")


def require_bearer(authorization: str | None, keys: Sequence[str], what: str) -> None:
    """Raise :class:`Unauthorized` unless ``authorization`` is ``Bearer <one of keys>``
    (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip().encode()
    ok = scheme.lower() == "bearer" and any(secrets.compare_digest(given, k.encode()) for k in keys)
    if not ok:
        raise Unauthorized(f"{what} needs Authorization: Bearer <key>")


class RouterError(Exception):
    """Base of every error the router reports to a client; ``status`` is the HTTP code."""

    status = 500
    type = "internal_error"
    #: the exit status of ``kvrouter serve`` when this stops it at start (its message the one
    #: line it prints); distinct per kind, so a supervisor can tell a bad setting (retrying will
    #: not help) from a worker not up yet or a port still held (it may)
    exit_code = 1

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: the request field at fault (OpenAI's ``param``), when one is
        self.param = param


class ConfigError(RouterError):
    """Invalid settings: the message names the bad key (a ``tokenizer: hf:`` directory
    without ``tokenizer.json`` too)."""

    type = "config_error"
    exit_code = 2


class StartupError(RouterError):
    """The router cannot start though its settings are valid: something they name is not
    there as they say. (Not 3: uvicorn's own exit status for a start-up that failed otherwise,
    with a traceback.)"""

    type = "startup_error"


class WorkerUnusable(StartupError):
    """A configured worker cannot be set up at start: its event endpoints unknown (no
    ``events=`` and no ``GET /kv_event_sources``) or not subscribable. It may not be up yet."""

    exit_code = 4


class ListenError(StartupError):
    """The router's address cannot be listened on: held by another server, not this machine's,
    or a privileged port."""

    exit_code = 5

    @classmethod
    def binding(cls, host: str, port: int, e: OSError, flag: str = "--port") -> ListenError:
        """The error for ``e``, raised binding ``host:port``, saying what to do; ``flag`` is the
        option that named the port."""
        if e.errno == errno.EADDRINUSE:  # (8000, the default, is vLLM's default too)
            what = (
                f"the port is in use by another program: give another {flag}, "
                f"or {flag} 0 for any free port"
            )
        elif e.errno == errno.EACCES:
            what = (
                f"permission denied (a port below 1024 needs privileges): give a {flag} above 1023"
            )
        elif e.errno == errno.EADDRNOTAVAIL or (e.errno or 0) < 0:  # (< 0: getaddrinfo's)
            what = "not an address of this machine: give --host 127.0.0.1, or 0.0.0.0 for all"
        else:
            what = e.strerror or str(e)
        return cls(f"cannot listen on {host}:{port}: {what}")


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class UnprocessableEntity(RouterError):
    status = 422
    type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"


class Forbidden(RouterError):
    status = 403
    type = "permission_error"


class NotFound(RouterError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(RouterError):
    status = 405
    type = "invalid_request_error"


class Conflict(RouterError):
    status = 409
    type = "conflict_error"


class RequestTimeout(RouterError):
    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"


class TooManyRequests(RouterError):
    status = 429
    type = "rate_limit_error"


class NoHealthyWorker(RouterError):
    status = 503
    type = "service_unavailable"


class BadGateway(RouterError):
    """The chosen worker failed (every candidate tried, or one that may have the request).
    Not to be confused with :class:`router.fleet.upstream.UpstreamError`, the HTTP client's own
    failure, which the proxy translates into this."""

    status = 502
    type = "upstream_error"


class GatewayTimeout(RouterError):
    """The chosen worker sent no response head in time (it may have the request: no retry)."""

    status = 504
    type = "upstream_error"


class TokenizeError(RouterError):
    status = 400
    type = "invalid_request_error"


class ErrorDetail(msgspec.Struct):
    """OpenAI's error object: clients parse ``param`` and ``code`` too (null when not known)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_encode = msgspec.json.Encoder().encode


def error_json(message: str, type_: str, param: str | None = None) -> bytes:
    """The body of every error answer: ``{"error": {"message", "type", "param", "code"}}``."""
    return _encode(ErrorBody(ErrorDetail(message, type_, param)))
