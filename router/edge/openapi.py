"""The router's OpenAPI document and the ``/docs`` page that renders it.

The endpoints are plain Starlette routes and an ASGI fast path for ``POST /route``, so FastAPI
infers nothing from them; the document is built here from the same msgspec Structs the handlers
decode and encode (``router.edge.bodies``, ``router.errors``), so it cannot drift from what is parsed.
The one rewrite: ``RouteRequest.token_ids`` is kept as raw JSON text on the hot path (it is hashed
from the text); the document describes what that text must be, an array of token ids.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.edge.bodies import ChatBody, CompletionBody, RouteOut, RouteRequest, TokenId, WorkerIn
from router.errors import ErrorBody

__all__ = ["openapi_document"]

_REF = "#/components/schemas/{name}"


def _documented_route_request() -> type:
    fields: list[tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(RouteRequest):
        if f.name == "token_ids":
            fields.append((f.name, list[TokenId] | None, None))
        else:
            fields.append((f.name, f.type, f.default))
    return msgspec.defstruct("RouteRequest", fields)


def _body(name: str) -> dict[str, Any]:
    return {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}},
    }


def _answer(description: str, name: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description}
    if name is not None:
        out["content"] = {"application/json": {"schema": {"$ref": _REF.format(name=name)}}}
    return out


_ERRORS = {
    "400": _answer(
        "malformed JSON (also: not UTF-8, nested past 128 levels, a field given twice) or a "
        "request the router cannot place",
        "ErrorBody",
    ),
    "401": _answer("an API key is configured and the request lacks it", "ErrorBody"),
    "413": _answer("body over proxy.max_body_bytes", "ErrorBody"),
    "422": _answer("valid JSON of the wrong shape; the message names the field", "ErrorBody"),
    "503": _answer("no healthy worker serves the model", "ErrorBody"),
}
_PROXY_ERRORS = {
    **_ERRORS,
    "502": _answer("the worker failed before the first byte", "ErrorBody"),
    "504": _answer("the worker did not answer in time", "ErrorBody"),
}


def openapi_document(version: str) -> dict[str, Any]:
    """OpenAPI 3.1 for the client and admin endpoints (``/metrics`` is Prometheus text)."""
    _, components = msgspec.json.schema_components(
        [_documented_route_request(), RouteOut, CompletionBody, ChatBody, WorkerIn, ErrorBody],
        ref_template=_REF,
    )
    client: list[dict[str, list[str]]] = [{"apiKey": []}, {}]  # a key only with api_keys set
    admin: list[dict[str, list[str]]] = [{"adminKey": []}]
    paths: dict[str, Any] = {
        "/route": {
            "post": {
                "summary": "Where would this request go, and why",
                "description": (
                    "Scores every worker (prefix overlap by tier, load) and returns the choice "
                    "with each candidate's cost. Give token_ids, prompt or messages. With "
                    "account=true the placement is charged as load until released."
                ),
                "requestBody": _body("RouteRequest"),
                "responses": {"200": _answer("the placement", "RouteOut"), **_ERRORS},
                "security": client,
            }
        },
        "/route/{route_id}/release": {
            "post": {
                "summary": "Release an accounted placement",
                "parameters": [_path_param("route_id")],
                "responses": {"200": _answer("released"), "404": _answer("unknown", "ErrorBody")},
                "security": client,
            }
        },
        "/v1/completions": _proxied("Completions", "CompletionBody", client),
        "/v1/chat/completions": _proxied("Chat completions", "ChatBody", client),
        "/v1/models": {"get": {"summary": "Models served", "responses": {"200": _answer("list")}}},
        "/workers": {
            "get": {
                "summary": "Workers with health, event stream and load",
                "responses": {"200": _answer("workers"), "403": _answer("no key", "ErrorBody")},
                "security": admin,
            },
            "post": {
                "summary": "Register a worker",
                "requestBody": _body("WorkerIn"),
                "responses": {"200": _answer("added"), "403": _answer("no key", "ErrorBody")},
                "security": admin,
            },
        },
        "/workers/{worker_id}": {
            "delete": {
                "summary": "Remove a worker and its index entries",
                "parameters": [_path_param("worker_id")],
                "responses": {"200": _answer("deleted"), "403": _answer("no key", "ErrorBody")},
                "security": admin,
            }
        },
        "/health": {"get": {"summary": "Liveness", "responses": {"200": _answer("alive")}}},
        "/ready": {
            "get": {
                "summary": "Readiness: a healthy worker with a live event stream, not draining",
                "responses": {"200": _answer("ready"), "503": _answer("not ready")},
            }
        },
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": _answer("")}}},
        "/admin/snapshot": {
            "get": {
                "summary": "The index and each worker rank's last applied event (msgpack)",
                "description": "What a peer replica warm-starts from (replicas.warm_from): "
                "Bearer the peer key's snapshot token (replicas.peer_key_file) or the admin key",
                "responses": {
                    "200": _answer("the snapshot"),
                    "401": _answer("neither the peer token nor the admin key", "ErrorBody"),
                    "403": _answer("no key", "ErrorBody"),
                },
                "security": admin,
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvrouter", "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer"},
                "adminKey": {"type": "http", "scheme": "bearer"},
            },
        },
    }


def _proxied(what: str, body: str, security: list[dict[str, list[str]]]) -> dict[str, Any]:
    """An OpenAI endpoint the router places and forwards."""
    return {
        "post": {
            "summary": f"{what}, proxied to the chosen worker",
            "description": "OpenAI-compatible; the body is forwarded as sent, streamed or not",
            "requestBody": _body(body),
            "responses": {"200": _answer("the worker's answer"), **_PROXY_ERRORS},
            "security": security,
        }
    }


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
