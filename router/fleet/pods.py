"""What a worker pod or a ``GET /kv_event_sources`` answer means as a router worker: which pods
are ready, the :class:`~router.settings.WorkerConfig` a pod stands for (ports, data-parallel ranks,
model and pool from its annotations), and the event endpoints vLLM lists for its ranks.
:mod:`router.fleet.discovery` (Kubernetes) and :class:`router.runtime.Runtime` (a configured
worker given without ``events=``) call them. One function does I/O: :func:`fetch_sources`, the one reader of
``GET /kv_event_sources``; the rest are pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from indexer.hosts import is_wildcard
from router.fleet.upstream import BodyTooLarge, UpstreamError, UpstreamPool
from router.settings import EVENTS_NONE, DiscoverySettings, WorkerConfig

__all__ = [
    "EventSource",
    "NoEventSource",
    "PodNotUsable",
    "decode_sources",
    "fetch_sources",
    "pod_ready",
    "sources_to_endpoints",
    "worker_for_pod",
]

_MAX_SOURCES_BYTES = 64 * 1024  # a /kv_event_sources answer is a few hundred bytes


class PodNotUsable(Exception):
    """A ready pod whose worker cannot be described (yet): bad annotation, endpoints unreadable."""


class NoEventSource(PodNotUsable):
    """The worker answers but names no KV event source (``/kv_event_sources`` absent or
    empty: an engine without events, vLLM started without ``--kv-events-config``): it joins
    approximate (``events_endpoint: none``)."""


class EventSource(msgspec.Struct):
    """One entry of a ``GET /kv_event_sources`` answered as a JSON array of these."""

    endpoint: str
    data_parallel_rank: int = 0
    replay_endpoint: str | None = None
    topic: str = ""


class _RankConfig(msgspec.Struct):
    """One data-parallel rank's KV events config, as vLLM 0.32 answers ``/kv_event_sources``:
    ``{"0": {"endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ...}, ...}``."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


_decode_answer = msgspec.json.Decoder(list[EventSource] | dict[str, _RankConfig]).decode


def decode_sources(body: bytes) -> list[EventSource]:
    """Both shapes: a list of sources, or vLLM's map from rank to its events config."""
    answer = _decode_answer(body)
    if isinstance(answer, list):
        return answer
    try:
        return [
            EventSource(c.endpoint, int(rank), c.replay_endpoint, c.topic)
            for rank, c in answer.items()
        ]
    except ValueError as e:
        raise msgspec.ValidationError(f"rank {e} is not an integer") from e


def pod_ready(pod: Any) -> bool:
    """Running, not being deleted, with an IP and the ``Ready`` condition true."""
    meta, status = pod.metadata, pod.status
    if meta is None or meta.deletionTimestamp is not None or status is None:
        return False
    if status.phase != "Running" or not status.podIP:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _port(value: str, what: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise PodNotUsable(f"annotation {what}={value!r} is not a port")
    return port


def worker_for_pod(
    pod: Any, s: DiscoverySettings, sources: list[EventSource] | None = None
) -> WorkerConfig:
    """The worker a ready pod stands for; ``sources`` from its ``/kv_event_sources`` when
    ``endpoints: kv_event_sources`` (none: it publishes no events, as with the annotation
    ``events-port: none``). Raises :class:`PodNotUsable` naming what is wrong."""
    ann: Mapping[str, str] = pod.metadata.annotations or {}
    pre = s.annotation_prefix

    def get(name: str) -> str | None:
        return ann.get(pre + name)

    ip = _host(pod.status.podIP)
    http = get("http-port")
    http_port = _port(http, pre + "http-port") if http is not None else s.http_port
    dp = get("dp-ranks")
    try:
        dp_ranks = int(dp) if dp is not None else 1
    except ValueError as e:
        raise PodNotUsable(f"annotation {pre}dp-ranks={dp!r} is not an integer") from e
    ev = get("events-port")
    if sources == [] or (sources is None and ev is not None and ev.lower() == EVENTS_NONE):
        events, replay = EVENTS_NONE, None  # no events: an approximate worker
    elif sources is not None:
        events, replay, dp_ranks = _from_sources(sources, ip)
    else:
        events = f"tcp://{ip}:{_port(ev, pre + 'events-port') if ev is not None else s.events_port}"
        rp = get("replay-port")
        if rp is not None and rp.lower() == "none":
            replay = None
        elif rp is not None:
            replay = f"tcp://{ip}:{_port(rp, pre + 'replay-port')}"
        else:
            replay = f"tcp://{ip}:{s.replay_port}" if s.replay_port else None
    try:
        return WorkerConfig(
            id=pod.metadata.name,
            url=f"http://{ip}:{http_port}",
            events_endpoint=events,
            replay_endpoint=replay,
            dp_ranks=dp_ranks,
            pool=get("pool") or None,
            model=get("model") or "",
        )
    except ValueError as e:  # WorkerConfig's own checks: "`dp_ranks` must be between 1 and 1024"
        raise PodNotUsable(str(e).replace("`", "")) from e


async def fetch_sources(http: UpstreamPool, base_url: str, timeout_s: float) -> list[EventSource]:
    """A worker's ``GET /kv_event_sources``, read to at most 64 KiB within ``timeout_s``.
    ``base_url`` comes from the operator's config or the API server's pod IP, never from a
    client. Raises :class:`PodNotUsable` naming the URL and what is wrong."""
    url = base_url + "/kv_event_sources"
    try:
        status, body = await http.get(base_url, "/kv_event_sources", timeout_s, _MAX_SOURCES_BYTES)
    except BodyTooLarge as e:
        raise PodNotUsable(f"GET {url}: answer larger than 64 KiB") from e
    except UpstreamError as e:
        raise PodNotUsable(f"GET {url} failed: {type(e).__name__}: {e}") from e
    if status == 404:
        raise NoEventSource(f"GET {url} answered 404")
    if status != 200:
        raise PodNotUsable(f"GET {url} answered {status}")
    try:
        return decode_sources(bytes(body))
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # (msgspec's own for bad UTF-8)
        raise PodNotUsable(f"GET {url}: not a list of KV event sources: {e}") from e


def sources_to_endpoints(sources: list[EventSource], host: str) -> tuple[str, str | None, int]:
    """(events, replay, dp ranks) from a worker's ``/kv_event_sources`` answer, wildcard bind
    addresses replaced by ``host``; raises :class:`PodNotUsable` naming what is wrong."""
    return _from_sources(sources, _host(host))


def _from_sources(sources: list[EventSource], ip: str) -> tuple[str, str | None, int]:
    """(events, replay, dp ranks) from vLLM's list. The router subscribes to rank r at the base
    port + r, so the ranks must be 0..n-1 on consecutive ports (vLLM's own layout)."""
    if not sources:
        raise NoEventSource("/kv_event_sources lists no source")
    by_rank = sorted(sources, key=lambda x: x.data_parallel_rank)
    if [x.data_parallel_rank for x in by_rank] != list(range(len(by_rank))):
        raise PodNotUsable("/kv_event_sources ranks are not 0..n-1")

    def local(ep: str) -> tuple[str, int]:
        scheme, sep, rest = ep.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme != "tcp" or not sep or not port.isdigit():
            raise PodNotUsable(f"/kv_event_sources endpoint {ep!r} is not tcp://host:port")
        # a publisher bound on every interface reports its bind address: use the pod's IP
        return (ip if is_wildcard(host) else host), int(port)

    events = [local(x.endpoint) for x in by_rank]
    replays = [local(x.replay_endpoint) if x.replay_endpoint else None for x in by_rank]
    for key, eps in (("endpoint", events), ("replay_endpoint", replays)):
        first = eps[0]
        if any((e is None) != (first is None) for e in eps):
            raise PodNotUsable(f"/kv_event_sources: {key} set on some ranks only")
        if first is not None and any(e != (first[0], first[1] + r) for r, e in enumerate(eps)):
            raise PodNotUsable(f"/kv_event_sources: {key} of rank r is not on port base + r")
    replay = f"tcp://{replays[0][0]}:{replays[0][1]}" if replays[0] is not None else None
    return f"tcp://{events[0][0]}:{events[0][1]}", replay, len(by_rank)
