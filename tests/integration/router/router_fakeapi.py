"""A small Kubernetes API server for the discovery tests: pods only, LIST and WATCH, on a real
HTTP server on 127.0.0.1 (uvicorn, port 0).

This is a seam fake (no real API server can run on these machines): it speaks the real wire
format — ``GET /api/v1/namespaces/{ns}/pods`` answers a ``PodList`` with
``metadata.resourceVersion``; with ``watch=true`` it streams newline-delimited
``{"type": ADDED|MODIFIED|DELETED|ERROR, "object": ...}`` events after the requested
``resourceVersion``, and a version older than its retained history gets the API server's answer:
an ``ERROR`` event carrying a ``Status`` with code 410 (``Expired``), or, if asked, a plain HTTP 410.
``labelSelector`` equality terms are honoured. Tests drive it: ``put``/``delete`` pods, ``compact``
the history, ``drop_watches`` (a clean end of stream, or an abrupt connection reset), and
``watch_status`` to refuse watches for a while.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from router_fakeworker import ServerHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

_CLOSE = "close"
_RESET = "reset"


def make_pod(
    name: str,
    *,
    ready: bool = True,
    ip: str = "127.0.0.1",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    namespace: str = "kv",
) -> dict[str, Any]:
    """A pod as the API server shows it (resourceVersion filled in by :meth:`FakeApiServer.put`)."""
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "labels": labels if labels is not None else {"app": "vllm"},
            "annotations": annotations or {},
        },
        "spec": {"containers": [{"name": "worker", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeApiServer:
    def __init__(self, *, expired_as: str = "event") -> None:
        self.rv = 100
        self.pods: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest = self.rv  # a watch from a version below this one is expired (410)
        self.expired_as = expired_as  # "event" (ERROR event in a 200 stream) or "status" (410)
        self.watch_status: int | None = None  # refuse watches with this HTTP status
        self.lists: list[dict[str, str]] = []  # query params of every LIST
        self.watches: list[dict[str, str]] = []  # ... and of every WATCH
        self.expired = 0  # 410s sent
        self._streams: set[asyncio.Queue[Any]] = set()
        self.http: ServerHandle | None = None
        self.app = Starlette(routes=[Route("/api/v1/namespaces/{ns}/pods", self._pods)])

    async def start(self) -> FakeApiServer:
        self.http = await ServerHandle(self.app).start()
        return self

    @property
    def url(self) -> str:
        assert self.http is not None
        return self.http.url

    async def aclose(self) -> None:
        self.drop_watches()
        if self.http is not None:
            await self.http.stop()

    # ------------------------------------------------------------- state changes

    def _emit(self, kind: str, pod: dict[str, Any]) -> None:
        self.history.append((self.rv, kind, pod))
        for q in self._streams:
            q.put_nowait((self.rv, kind, pod))

    def put(self, pod: dict[str, Any]) -> int:
        self.rv += 1
        pod = json.loads(json.dumps(pod))
        pod["metadata"]["resourceVersion"] = str(self.rv)
        name = pod["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        self.pods[name] = pod
        self._emit(kind, pod)
        return self.rv

    def delete(self, name: str) -> int:
        self.rv += 1
        pod = self.pods.pop(name)
        pod = json.loads(json.dumps(pod))
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self._emit("DELETED", pod)
        return self.rv

    def compact(self) -> None:
        """Forget the history: a watch from any version before now is answered 410."""
        self.history.clear()
        self.oldest = self.rv

    def drop_watches(self, *, abrupt: bool = False) -> None:
        for q in self._streams:
            q.put_nowait(_RESET if abrupt else _CLOSE)

    @property
    def open_watches(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------- HTTP

    @staticmethod
    def _matches(pod: dict[str, Any], selector: str) -> bool:
        labels = pod["metadata"].get("labels") or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    async def _pods(self, request: Request) -> Response:
        params = dict(request.query_params)
        selector = params.get("labelSelector", "")
        if params.get("watch") != "true":
            self.lists.append(params)
            items = [p for p in self.pods.values() if self._matches(p, selector)]
            body = {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
            return JSONResponse(body)
        self.watches.append(params)
        if self.watch_status is not None:
            msg = "the fake API server refuses watches for now"
            return JSONResponse(
                _status(self.watch_status, "ServiceUnavailable", msg), self.watch_status
            )
        since = int(params.get("resourceVersion") or 0)
        if since < self.oldest:
            self.expired += 1
            msg = f"too old resource version: {since} ({self.oldest})"
            gone = _status(410, "Expired", msg)
            if self.expired_as == "status":
                return JSONResponse(gone, 410)

            async def expired() -> AsyncIterator[bytes]:
                yield json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n"

            return StreamingResponse(expired(), media_type="application/json")
        q: asyncio.Queue[Any] = asyncio.Queue()
        for rv, kind, pod in self.history:  # replayed and subscribed with no await between
            if rv > since:
                q.put_nowait((rv, kind, pod))
        self._streams.add(q)

        async def stream() -> AsyncIterator[bytes]:
            try:
                while True:
                    item = await q.get()
                    if item == _CLOSE:
                        return
                    if item == _RESET:
                        raise ConnectionResetError("the fake API server drops this watch")
                    _, kind, pod = item
                    if self._matches(pod, selector):
                        yield json.dumps({"type": kind, "object": pod}).encode() + b"\n"
            finally:
                self._streams.discard(q)

        return StreamingResponse(stream(), media_type="application/json")
