"""Joining and leaving a router's worker registry (``POST /workers``, ``DELETE /workers/{id}``)."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["RegistrationError", "deregister", "register"]


class RegistrationError(RuntimeError):
    """The router could not be reached or refused the registration."""


def _headers(admin_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_key}"} if admin_key else {}


async def register(
    router: str,
    *,
    worker_id: str,
    url: str,
    events: str | None,
    replay: str | None,
    model: str = "",
    pool: str | None = None,
    admin_key: str | None = None,
    timeout: float = 10.0,
) -> None:
    if events is None:
        raise RegistrationError("cannot register with a router without an --events endpoint")
    body: dict[str, Any] = {"id": worker_id, "url": url, "events_endpoint": events, "model": model}
    if replay:
        body["replay_endpoint"] = replay
    if pool:
        body["pool"] = pool
    target = router.rstrip("/") + "/workers"
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            r = await client.post(target, json=body, headers=_headers(admin_key))
    except httpx.HTTPError as exc:
        raise RegistrationError(f"cannot register with {target}: {exc}") from exc
    if r.status_code >= 300:
        raise RegistrationError(f"{target} refused the registration: {r.status_code} {r.text}")


async def deregister(
    router: str, worker_id: str, *, admin_key: str | None = None, timeout: float = 5.0
) -> None:
    target = f"{router.rstrip('/')}/workers/{worker_id}"
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            r = await client.delete(target, headers=_headers(admin_key))
    except httpx.HTTPError as exc:
        raise RegistrationError(f"cannot deregister from {target}: {exc}") from exc
    if r.status_code >= 300 and r.status_code != 404:
        raise RegistrationError(f"{target} refused the deregistration: {r.status_code} {r.text}")
