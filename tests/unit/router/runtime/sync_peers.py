"""Shared by the replica sync tests: a ``ReplicaSync`` around its own placer (workers ``a`` and
``b``, rank 0, known to its index), a frame as a peer sends it, a peer key file, and raw ZMQ
peers (a PUB or SUB with or without CURVE) acting as strangers, spoofers and floods."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from indexer.index import PrefixIndex
from router.fleet.registry import Registry
from router.placement import PlacementSettings, Placer
from router.runtime.replicas import ReplicaSync, peer_key
from router.runtime.replicas.wire import VERSION, SyncMessage, encode
from router.settings import ReplicaSettings, WorkerConfig, load_settings

BS = 16
SECRET = "0123456789abcdef0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def placer(clock: Callable[[], float], **replicas: object) -> Placer:
    settings = load_settings(
        environ={}, overrides={"workers": [], "block_size": BS, "replicas": replicas}
    )
    fleet = Registry(settings.health, clock=clock)
    index = PrefixIndex(BS)
    for wid in ("a", "b"):
        fleet.add(WorkerConfig(id=wid, url=f"http://{wid}.invalid", events_endpoint="tcp://x:1"))
        index.add_worker(wid, 0)
    return Placer(PlacementSettings.of(settings), index, fleet, clock=clock)


def sync(clock: Callable[[], float] = time.monotonic, **replicas: object) -> ReplicaSync:
    """Trusted (no key) unless ``peer_key_file`` is given."""
    if "peer_key_file" not in replicas:
        replicas = {"trusted_network": True, **replicas}
    p = placer(clock, **replicas)
    rs = ReplicaSettings(**replicas)  # type: ignore[arg-type]
    s = ReplicaSync(rs, p, block_size=BS, clock=clock, key=peer_key(rs))
    p.listener = s
    return s


def msg(seq: int, events: list, *, origin: str = "peer", block_size: int = BS) -> list[bytes]:
    return [encode(SyncMessage(VERSION, origin, seq, block_size, events))]


def key_file(tmp: Path, secret: str = SECRET, name: str = "peer-key") -> str:
    path = tmp / name
    path.write_text(secret + "\n")
    return str(path)


def raw_pub(
    ctx: zmq.Context[Any], *, curve: tuple[bytes, bytes] | None = None, xpub: bool = False
) -> tuple[zmq.Socket[bytes], str]:
    """A PUB bound on a free loopback port (a CURVE server of ``curve`` = (public, secret)); an
    XPUB with ``xpub``, which hears each subscription (:func:`subscribed`): from then on
    nothing it sends is lost to the subscriber's late join."""
    s: zmq.Socket[bytes] = ctx.socket(zmq.XPUB if xpub else zmq.PUB, socket_class=zmq.Socket)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.curve_server = True
        s.curve_publickey, s.curve_secretkey = curve
    s.bind("tcp://127.0.0.1:0")
    return s, s.getsockopt_string(zmq.LAST_ENDPOINT)


def raw_sub(
    ctx: zmq.Context[Any], ep: str, *, curve: tuple[bytes, bytes, bytes] | None = None
) -> zmq.Socket[bytes]:
    """A SUB to everything on ``ep`` (a CURVE client of ``curve`` = (public, secret, server))."""
    s: zmq.Socket[bytes] = ctx.socket(zmq.SUB, socket_class=zmq.Socket)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    if curve is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
    s.connect(ep)
    return s


def subscribed(xpub: zmq.Socket[bytes]) -> bool:
    """Whether a subscriber's subscription reached ``xpub`` (read now, without blocking)."""
    try:
        return xpub.recv(zmq.NOBLOCK)[:1] == b"\x01"
    except zmq.Again:
        return False


def drain(sock: zmq.Socket[bytes]) -> int:
    """How many messages were waiting on ``sock`` (read now, without blocking)."""
    n = 0
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return n
        n += 1
