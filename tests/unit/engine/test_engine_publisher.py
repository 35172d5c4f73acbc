"""Event publisher: vLLM wire format on real ZMQ sockets, seq from 0 per process, bounded replay."""

from __future__ import annotations

import zmq
from engine_helpers import Collector, connected, free_port

from engine.publisher import EventPublisher, bindable
from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored
from indexer.wire import decode_payload, decode_replay_reply, encode_replay_request


def _stored(h: int) -> BlockStored:
    return BlockStored(
        block_hashes=[h], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
        tier="CPU_PINNED", medium="CPU_PINNED",
    )  # fmt: skip


def _replay(endpoint: str, start: int) -> list[tuple[int, bytes | None, bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode_replay_request(start))
        out = []
        while True:
            assert sock.poll(10_000), "no replay reply"
            r = decode_replay_reply(sock.recv_multipart())
            out.append((r.seq, r.topic, r.payload))
            if r.is_end:
                return out
    finally:
        sock.close(0)
        ctx.term()


def test_bindable_turns_port_zero_into_a_wildcard() -> None:
    assert bindable("tcp://127.0.0.1:0") == "tcp://127.0.0.1:*"
    assert bindable("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"


def test_messages_carry_topic_seq_from_zero_and_the_dp_rank() -> None:
    with EventPublisher("tcp://127.0.0.1:0", None, topic="kv", dp_rank=3) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        assert pub.next_seq == 0
        col = Collector(pub.endpoint)
        try:
            connected(pub, col, lambda: pub.publish([AllBlocksCleared()]))
            first = pub.next_seq
            assert pub.publish([]) is None  # nothing to say: no message, no seq used
            assert pub.publish([_stored(1), BlockRemoved(block_hashes=[1], tier="GPU")]) == first
            col.until_seq(first)
        finally:
            col.close()
    # probes sent before the SUB joined are lost (ZMQ PUB); the rest arrive in order, no gaps
    assert [b.seq for b in col.batches] == list(range(col.batches[0].seq, first + 1))
    last = col.batches[-1]
    assert last.topic == b"kv" and last.dp_rank == 3
    assert last.events[0] == _stored(1)
    assert isinstance(last.events[1], BlockRemoved) and last.events[1].tier == "GPU"


def test_replay_serves_the_bounded_buffer_with_the_topic_frame() -> None:
    with EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv", buffer_size=3) as pub:
        assert pub.replay_endpoint is not None
        for h in range(5):
            pub.publish([_stored(h)], ts=100.0 + h)
        got = _replay(pub.replay_endpoint, 0)
        assert [s for s, _, _ in got] == [2, 3, 4, -1]  # seq 0 and 1 fell out of the buffer
        assert all(t == b"kv" for s, t, _ in got if s >= 0)
        assert got[-1][2] == b""
        batch = decode_payload(got[0][2])
        assert batch.ts == 100.0 + 2 and batch.events == [_stored(2)]
        assert [s for s, _, _ in _replay(pub.replay_endpoint, 4)] == [4, -1]
        assert [s for s, _, _ in _replay(pub.replay_endpoint, 9)] == [-1]


def test_a_restarted_publisher_counts_from_zero_again() -> None:
    port, rport = free_port(), free_port()
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    pub = EventPublisher(endpoint, replay)
    col = Collector(endpoint)
    try:
        connected(pub, col, lambda: pub.publish([AllBlocksCleared()]))
        for h in range(3):
            pub.publish([_stored(h)])
        col.until_seq(pub.next_seq - 1)
        pub.close()
        pub = EventPublisher(endpoint, replay)  # same addresses, fresh process state
        assert pub.next_seq == 0
        # the SUB reconnects by itself; what it gets now is numbered by the new process
        connected(pub, col, lambda: pub.publish([AllBlocksCleared()]))
        seq = pub.publish([_stored(99)])
        col.until_seq(seq or 0)
        assert [b.seq for b in col.batches if b.events == [_stored(99)]] == [seq]
        replayed = _replay(replay, 0)
        assert replayed[0][0] == 0 and [s for s, _, _ in replayed] == [*range(pub.next_seq), -1]
    finally:
        col.close()
        pub.close()
