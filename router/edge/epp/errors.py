"""The endpoint picker's exception tree: a stream it cannot go on with is closed with the gRPC
status its error names (Envoy then fails the request, or lets it through where its ext_proc
filter is ``failure_mode_allow``). An error the client should see is a
:class:`router.errors.RouterError`, answered as an ``ImmediateResponse`` instead."""

from __future__ import annotations

__all__ = ["EppError", "ProtocolError", "Unsupported"]


class EppError(Exception):
    """A stream closed with gRPC status ``code`` (a ``grpc.StatusCode`` name) and this message."""

    code = "INTERNAL"


class ProtocolError(EppError):
    """Not what an ext_proc client sends: a malformed message, or a phase out of order."""

    code = "INVALID_ARGUMENT"


class Unsupported(EppError):
    """An ext_proc processing mode the picker does not speak (its ``protocol_config``)."""

    code = "FAILED_PRECONDITION"
