"""Peers from Kubernetes (``replicas.discovery``): the router's own pods, listed every
``interval_s`` (:class:`router.fleet.peers.RouterPods`), become replica sync's peers
(``tcp://<podIP>:<the port of sync_bind>``) and, when ready, the replicas a starting one
warm-starts from (``http://<podIP>:<port>``). Every replica runs the same Deployment, so the
ports are this replica's own."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from router.fleet.peers import RouterPods
from router.settings import Settings

__all__ = ["follow_peers", "sync_port", "warm_urls"]

log = logging.getLogger("kvrouter.replicas")


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def sync_port(sync_bind: str) -> int:
    """The TCP port of ``replicas.sync_bind`` (the settings check that there is one)."""
    port = urlsplit(sync_bind.replace("tcp://", "http://", 1)).port
    assert port, sync_bind
    return port


async def warm_urls(settings: Settings) -> list[str]:
    """``replicas.warm_from``, then the ready router pods other than this one (its pod name is
    its host name) when discovery is on; a failed listing leaves only the configured ones."""
    rs = settings.replicas
    urls = list(rs.warm_from)
    if not rs.discovery.enabled:
        return urls
    try:
        pods = await asyncio.wait_for(RouterPods(rs.discovery).list(), rs.discovery.timeout_s)
    except Exception as e:  # (no API server: a cold start, as without peers)
        log.warning("warm start: listing the router's pods failed: %r", e)
        return urls
    me = socket.gethostname()
    urls += [f"http://{_host(p.ip)}:{settings.port}" for p in pods if p.ready and p.name != me]
    return urls


async def follow_peers(
    pods: RouterPods, port: int, set_peers: Callable[[Iterable[str]], None]
) -> None:
    """Until cancelled: the running router pods' sync endpoints to ``set_peers`` (this pod's
    own included: its messages are told apart by their origin)."""
    s = pods.settings
    while True:
        try:
            found = await asyncio.wait_for(pods.list(), 2 * s.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the API server is away: keep the peers we have
            log.warning("replica discovery: listing the router's pods failed: %r", e)
        else:
            set_peers([f"tcp://{_host(p.ip)}:{port}" for p in found])
        await asyncio.sleep(s.interval_s)
