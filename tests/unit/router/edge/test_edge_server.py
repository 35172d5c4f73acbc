"""The client connection cap derived from the file descriptor limit (``connection_limits``), the
soft limit raised at start, and the absolute-form target cut to its path (``origin_form``)."""

from __future__ import annotations

import itertools
import resource
import socket

import pytest

from router.edge import server
from router.edge.dispatch import origin_form
from router.edge.server import (
    FILES,
    HEALTH_PER_WORKER,
    ZMQ_PER_RANK,
    bind_listener,
    connection_limits,
)
from router.errors import ConfigError, ListenError


def limits(nofile: int, **kw: object) -> server.ConnectionLimits:
    args: dict[str, object] = dict(
        max_connections=2048, per_worker=1000, workers=1, ranks=1, dynamic=False
    )
    args.update(kw)
    return connection_limits(nofile, **args)  # type: ignore[arg-type]


def test_a_generous_limit_leaves_the_configured_cap_and_backlog() -> None:
    lim = limits(1 << 20)
    assert (lim.cap, lim.backlog, lim.nofile) == (2048, 2048, 1 << 20)
    assert lim.reserve == (1 << 20) - 2048
    assert limits(1 << 20, max_connections=10).cap == 10


def test_a_low_limit_keeps_a_worker_connection_per_client() -> None:
    # 256 - 64 files - 6 ZMQ - 4 health = 182; backlog 182 // 16 = 11, twice: 160 left;
    # 1000 connections per worker is more than half of it: half for clients, half for workers
    lim = limits(256)
    assert (lim.cap, lim.backlog, lim.reserve) == (80, 11, 176)
    # a fleet that can take fewer worker connections than that leaves the rest to clients:
    # 256 - 64 - 2 * 6 - 2 * 4 = 172, backlog 10, twice: 152 left, 2 * 10 for the workers
    assert limits(256, per_worker=10, workers=2, ranks=2).cap == 132
    # workers added at run time may take any number: half again
    assert limits(256, per_worker=10, workers=2, ranks=2, dynamic=True).cap == 76


def test_the_cap_and_what_it_leaves_always_fit_the_limit() -> None:
    grid = itertools.product(
        (128, 256, 1024, 4096, 65536), (1, 8, 1000), (0, 1, 4, 32), (1, 2), (False, True)
    )
    for nofile, per_worker, workers, dp, dynamic in grid:
        try:
            lim = limits(
                nofile, per_worker=per_worker, workers=workers, ranks=workers * dp, dynamic=dynamic
            )
        except ConfigError:
            assert nofile - FILES - workers * (ZMQ_PER_RANK * dp + HEALTH_PER_WORKER) < 40
            continue
        upstream = lim.cap if dynamic else min(per_worker * workers, lim.cap)
        own = FILES + workers * (ZMQ_PER_RANK * dp + HEALTH_PER_WORKER) + 2 * lim.backlog
        assert 1 <= lim.cap <= 2048 and 8 <= lim.backlog <= 2048
        assert lim.cap + upstream + own <= nofile, (nofile, per_worker, workers, dp, dynamic)
        assert lim.cap + lim.reserve == nofile


def test_a_limit_with_no_room_for_clients_fails_at_start_saying_so() -> None:
    with pytest.raises(ConfigError, match=r"RLIMIT_NOFILE 80 .*ulimit -n"):
        limits(80)


def test_the_soft_limit_is_raised_to_the_hard_one(monkeypatch) -> None:
    state = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (state["soft"], state["hard"]))

    def setrlimit(_: int, limits: tuple[int, int]) -> None:
        state["soft"], state["hard"] = limits

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert server.raise_nofile_limit() == (4096, 1024)
    assert state == {"soft": 4096, "hard": 4096}
    assert server.raise_nofile_limit() == (4096, 4096)  # already there: nothing to do

    def refused(_: int, limits: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    state["soft"] = 512
    monkeypatch.setattr(resource, "setrlimit", refused)
    assert server.raise_nofile_limit() == (512, 512)


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (b"http://evil:1/route", "/route"),
        (b"HTTPS://user@host/v1/chat/completions", "/v1/chat/completions"),
        (b"http://host", "/"),
        (b"http://host/a%20b", "/a b"),
    ],
)
def test_absolute_form_is_cut_to_its_path(raw: bytes, path: str) -> None:
    scope = {"type": "http", "path": raw.decode(), "raw_path": raw, "query_string": b"q=1"}
    cut = origin_form(scope)
    assert (cut["path"], cut["raw_path"]) == (path, path.replace(" ", "%20").encode())
    assert cut["query_string"] == b"q=1" and scope["path"] == raw.decode()  # a copy


@pytest.mark.parametrize("raw", [b"*", b"ftp://host/route", b"route"])
def test_other_targets_are_left_alone(raw: bytes) -> None:
    scope = {"type": "http", "path": raw.decode(), "raw_path": raw}
    assert origin_form(scope) is scope


def test_an_address_that_cannot_be_listened_on_says_what_to_do() -> None:
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        with pytest.raises(ListenError, match=r"in use .* give another --port, or --port 0"):
            bind_listener("127.0.0.1", port)
        with pytest.raises(ListenError, match=r"give another server.metrics_port"):
            bind_listener("127.0.0.1", port, "server.metrics_port")
    # TEST-NET-1 (RFC 5737): no machine's own address
    with pytest.raises(ListenError, match="not an address of this machine") as got:
        bind_listener("192.0.2.1", 0)
    assert got.value.exit_code == 5 and isinstance(got.value.__cause__, OSError)
