"""The router's exception hierarchy and its JSON error body ``{"error": {"message", "type"}}``:
the one home of both, at the bottom of the router's layers (no HTTP library here; the edge wraps
the body in a response, :func:`router.edge.bodies.error_response`).

Handlers raise these; the edge turns every one into the documented status code. Lower-level errors
(msgspec, httpx, tokenizers) are translated with ``raise ... from`` where they cross into the router.
"""

from __future__ import annotations

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
    "MethodNotAllowed",
    "NoHealthyWorker",
    "NotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "RouterError",
    "TokenizeError",
    "TooManyRequests",
    "Unauthorized",
    "UnprocessableEntity",
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

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: the request field at fault (OpenAI's ``param``), when one is
        self.param = param


class ConfigError(RouterError):
    """Invalid settings: raised at start, the message names the bad key."""

    type = "config_error"


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
