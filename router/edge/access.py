"""Request ids and the access log, for every request the router serves (an ASGI middleware;
the EPP's ext_proc streams write the same line through :func:`write_access`).

- ``x-request-id``: taken from the client when it is a plain token (≤ 128 of A-Z a-z 0-9 . _ : -),
  else generated; echoed on the answer and, through the request's headers, forwarded to the
  worker by the proxy.
- One log line per request on the ``kvrouter.access`` logger: method, path, status, worker,
  response bytes, time to the first body byte, duration and the request id; with
  ``scoring.explain`` also ``why`` (the answer's ``x-kvrouter-why``: the pick's blocks, cost and
  runner-up, :func:`router.edge.door.why`); with ``log_format: json`` (``--log-format json``)
  each line is one JSON object.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "WHY_HEADER",
    "AccessLog",
    "JsonFormatter",
    "request_id",
    "why_of",
    "write_access",
]

log = logging.getLogger("kvrouter.access")
_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
#: the pick's explanation (router.edge.door.why), which the access line repeats
WHY_HEADER = "x-kvrouter-why"
_WHY_BYTES = WHY_HEADER.encode()


def request_id(given: bytes | None) -> tuple[bytes, bool]:
    """The client's ``x-request-id`` when it is a plain token, else a new one; and whether it
    is new (the request does not carry it yet)."""
    if given is not None and _ID.fullmatch(given):
        return given, False
    return os.urandom(16).hex().encode(), True  # as random as a uuid4, a quarter of its cost


def write_access(
    method: str,
    path: str,
    status: int,
    worker: str,
    nbytes: int,
    ttfb: float | None,
    t0: float,
    rid: bytes,
    why: str = "",
) -> None:
    """The access line of one request (``t0``, ``ttfb``: on ``time.perf_counter``); ``why``:
    the pick's ``x-kvrouter-why``, when explained."""
    if not log.isEnabledFor(logging.INFO):
        return
    fields = {
        "method": method,
        "path": path,
        "status": status,
        "worker": worker,
        "bytes": nbytes,
        "ttfb_ms": None if ttfb is None else round(ttfb * 1e3, 3),
        "duration_ms": round((time.perf_counter() - t0) * 1e3, 3),
        "request_id": rid.decode("ascii"),
    }
    line = (
        "%(method)s %(path)s %(status)s worker=%(worker)s bytes=%(bytes)s "
        "ttfb_ms=%(ttfb_ms)s duration_ms=%(duration_ms)s request_id=%(request_id)s"
    )
    if why:
        fields["why"] = why
        line += ' why="%(why)s"'  # (its own fields are key=value too: quoted as one)
    log.info(line, fields, extra={"access": fields})


def why_of(headers: list[tuple[str, str]]) -> str:
    """The ``x-kvrouter-why`` among an answer's headers ("" when not explained)."""
    return next((v for k, v in headers if k == WHY_HEADER), "")


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid, new = request_id(given)
        if new:
            headers = [(k, v) for k, v in scope["headers"] if k != b"x-request-id"]
            scope = {**scope, "headers": [*headers, (b"x-request-id", rid)]}
        if not log.isEnabledFor(logging.INFO):  # no line to write: only the id to echo

            async def send_id(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = _with_id(message, message.get("headers", ()), rid)
                await send(message)

            await self.app(scope, receive, send_id)
            return
        t0 = time.perf_counter()
        seen: dict[str, Any] = {"status": 0, "worker": "", "bytes": 0, "ttfb": None, "why": ""}

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                seen["status"] = message["status"]
                for k, v in headers:
                    if k == b"x-kvrouter-worker":
                        seen["worker"] = v.decode("ascii", "replace")
                    elif k == _WHY_BYTES:
                        seen["why"] = v.decode("ascii", "replace")
                message = _with_id(message, headers, rid)
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if body and seen["ttfb"] is None:
                    seen["ttfb"] = time.perf_counter() - t0
                seen["bytes"] += len(body)
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            method, path = scope.get("method", ""), scope.get("path", "")
            worker, nbytes, ttfb = seen["worker"], seen["bytes"], seen["ttfb"]
            why = seen["why"]
            write_access(method, path, seen["status"], worker, nbytes, ttfb, t0, rid, why)


def _with_id(start: Message, headers: Any, rid: bytes) -> Message:
    """The response start ``start`` with ``headers`` and the request id."""
    return {**start, "headers": [*headers, (b"x-request-id", rid)]}


class JsonFormatter(logging.Formatter):
    """One JSON object per log line (``log_format: json``); access lines carry their fields;
    ``process``: the index of this process of ``kvrouter serve --processes N`` (a ``process``
    field on every line), None alone."""

    def __init__(self, process: int | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        if self.process is not None:
            out["process"] = self.process
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))
