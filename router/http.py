"""Serving a router app: uvicorn, through its public ``Config``, with the router's front-end limits.

Every request goes through ASGI; HTTP parsing and framing are uvicorn's: its h11 protocol by
default (``server.http``), which bounds the request head and keeps the body of a POST that also
proposes an ``Upgrade: h2c``; ``httptools`` is faster but has neither property (uvicorn 0.54). There is no protocol subclass here: an earlier one, built on uvicorn internals to save
microseconds, let pipelined and malformed input through in ways a maintained server does not.

What the router asks of uvicorn (``server:`` in the config):

- ``max_connections`` → ``limit_concurrency``: past it new connections and requests get 503,
  so idle sockets cannot exhaust the process's file descriptors;
- ``keep_alive_timeout_s`` → ``timeout_keep_alive``: an idle keep-alive connection is closed;
- ``max_header_bytes`` → ``h11_max_incomplete_event_size`` (with ``http: h11``);
- ``body_timeout_s``: enforced by :func:`router.api.read_body` around the body it reads;
- ``drain_grace_s`` → ``timeout_graceful_shutdown``: after SIGTERM ``/ready`` answers 503 at once
  and in-flight requests (streams included) get this long to finish.
"""

from __future__ import annotations

from typing import Any

import uvicorn

__all__ = ["server_config"]


def server_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config serving a router app (from :func:`router.app.create_app`) with the
    limits of its settings; ``kwargs`` (host, port, log_level...) win."""
    s = app.state.settings.server
    kwargs.setdefault("http", s.http)
    kwargs.setdefault("lifespan", "on")
    kwargs.setdefault("access_log", False)
    kwargs.setdefault("limit_concurrency", s.max_connections)
    kwargs.setdefault("timeout_keep_alive", s.keep_alive_timeout_s)
    kwargs.setdefault("h11_max_incomplete_event_size", s.max_header_bytes)
    kwargs.setdefault("timeout_graceful_shutdown", s.drain_grace_s)
    return uvicorn.Config(app, **kwargs)
