"""The subscriber's socket plane (``indexer/subscriber/sockets.py``): the one drain loop is bounded
per round and says when more may wait; monitor frames decode to their event id."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
import zmq

from indexer.subscriber.sockets import DRAIN_CAP, monitor_event, receive


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    b.bind("inproc://test-subscriber-sockets")
    a.connect("inproc://test-subscriber-sockets")
    yield a, b
    ctx.destroy(linger=0)


def test_receive_takes_at_most_a_round_then_the_rest(pair) -> None:
    a, b = pair
    assert receive(b) == []
    for i in range(DRAIN_CAP + 3):
        a.send_multipart([b"t", str(i).encode()])
    first = receive(b)
    assert len(first) == DRAIN_CAP  # full: the caller is drained again next round
    assert first[0] == [b"t", b"0"]
    rest = receive(b)
    assert [m[1] for m in rest] == [str(i).encode() for i in range(DRAIN_CAP, DRAIN_CAP + 3)]
    assert receive(b) == []


def test_monitor_event_reads_the_header_frame() -> None:
    frame = struct.pack("=Hi", zmq.EVENT_HANDSHAKE_SUCCEEDED, 7)
    assert monitor_event([frame, b"tcp://x:1"]) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert monitor_event([b"short", b""]) is None
