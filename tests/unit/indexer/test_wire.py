"""indexer.wire against the captured publisher bytes: every stream, replay and malformed fixture."""

from __future__ import annotations

import msgspec
import pytest

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from indexer.wire import (
    END_SEQ,
    FrameError,
    PayloadError,
    ReplayReply,
    SchemaError,
    WireError,
    decode_message,
    decode_payload,
    decode_replay_reply,
    decode_replay_request,
    encode_message,
    encode_payload,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_request,
)
from indexer.wire.loose import decode_loose
from tests.unit.indexer.wire_fixtures import (
    frames,
    load,
    normalize_batch,
    replay_files,
    stream_files,
    stream_frames,
)

STREAMS = stream_files()
REPLAYS = replay_files()
MALFORMED = load("malformed.json")["cases"]
VLLM_033 = ["vllm-0.33.0.json", "vllm-0.33.0-bytes-hashes.json"]


def test_fixture_inventory() -> None:
    # The parametrized tests below must not silently shrink if files go missing.
    assert len(STREAMS) == 10
    assert len(REPLAYS) == 3
    assert len(MALFORMED) == 36


@pytest.mark.parametrize("name", STREAMS)
def test_stream_decodes_to_expected(name: str) -> None:
    data = load(name)
    expected = data["expected"]["messages"]
    msgs = stream_frames(name)
    assert len(msgs) == len(expected) == len(data["steps"])
    for msg, want in zip(msgs, expected):
        batch = decode_message(msg)
        assert batch.topic == data["topic"].encode()
        assert batch.unknown_events == 0
        assert normalize_batch(batch) == {k: v for k, v in want.items() if k != "step"}


@pytest.mark.parametrize("name", STREAMS)
def test_loose_path_agrees_with_fast_path(name: str) -> None:
    # The reference decoder (used for anything the typed one rejects) reads every capture alike.
    for _topic, seq, payload in stream_frames(name):
        fast = decode_payload(payload, seq=int.from_bytes(seq, "big"), topic=b"t")
        assert decode_loose(payload, seq=fast.seq, topic=b"t") == fast


def test_sglang_049_root_parent_is_kept_as_sent() -> None:
    batch = decode_message(stream_frames("sglang-0.4.9.json")[0])
    first = batch.events[0]
    assert isinstance(first, BlockStored)
    assert first.parent_block_hash == 5740354900026072187


def test_bytes_hashes_stay_bytes() -> None:
    batch = decode_message(stream_frames("vllm-0.33.0-bytes-hashes.json")[1])
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in stored.block_hashes)
    assert isinstance(stored.parent_block_hash, bytes)


@pytest.mark.parametrize("name", VLLM_033)
def test_encoder_is_byte_identical_to_vllm_0330(name: str) -> None:
    for topic, seq, payload in stream_frames(name):
        batch = decode_message([topic, seq, payload])
        again = encode_payload(batch.events, ts=batch.ts, dp_rank=batch.dp_rank)
        assert again == payload, f"seq {batch.seq}: {again.hex()} != {payload.hex()}"
        assert encode_message(batch.topic, batch.seq, again) == [topic, seq, payload]


def test_encoder_without_rank_sends_nil_rank() -> None:
    payload = encode_payload([AllBlocksCleared()], ts=1.5, dp_rank=None)
    assert msgspec.msgpack.decode(payload) == [1.5, [{"type": "AllBlocksCleared"}], None]
    assert decode_payload(payload) == EventBatch(seq=0, ts=1.5, events=[AllBlocksCleared()])


def test_encoder_sends_tier_when_medium_is_missing() -> None:
    events = [
        BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[5] * 4, block_size=4, tier="DISK"
        ),
        BlockRemoved(block_hashes=[1], tier="CPU_PINNED"),
        BlockRemoved(block_hashes=[1]),
    ]
    raw = msgspec.msgpack.decode(encode_payload(events, ts=0.0))
    assert [e["medium"] for e in raw[1]] == ["DISK", "CPU_PINNED", None]
    assert [e.tier for e in decode_payload(encode_payload(events, ts=0.0)).events] == [
        "DISK",
        "CPU_PINNED",
        "GPU",
    ]


def test_encoder_rejects_non_events() -> None:
    with pytest.raises(TypeError, match="not a KV cache event"):
        encode_payload([object()], ts=0.0)  # type: ignore[list-item]


# -- shapes the captures do not cover ---------------------------------------------------------


def _payload(*events: object, rank: object = 0) -> bytes:
    return msgspec.msgpack.encode([1700000000.0, list(events), rank])


STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [11, 22],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
    "lora_id": None,
    "medium": "cpu_tier2",
}
STORED = BlockStored(
    block_hashes=[11, 22],
    parent_block_hash=None,
    token_ids=list(range(8)),
    block_size=4,
    tier="DISK",
    medium="cpu_tier2",
)


def test_unknown_keys_and_trailing_fields_are_ignored() -> None:
    future_map = {**STORED_MAP, "some_future_field": {"nested": [1, 2]}, "locality": 3}
    known = [None, None, [None, None], 0, None]  # lora_id, lora_name, extra_keys, group, kind
    positional = ["BlockStored", [11, 22], None, list(range(8)), 4, *known[:1], "cpu_tier2"]
    positional += [*known[1:], "x", 9]
    for event in (future_map, positional):
        assert decode_payload(_payload(event)).events == [STORED]


def test_unknown_events_are_skipped_and_counted_in_order() -> None:
    payload = _payload(
        {"type": "BlockMoved", "block_hashes": [1]},
        STORED_MAP,
        ["KVCacheCompacted", 1, 2],
        ["BlockRemoved", [11], "GPU"],
    )
    batch = decode_payload(payload, seq=7, topic=b"kv")
    assert batch.unknown_events == 2
    assert batch.seq == 7 and batch.topic == b"kv" and batch.dp_rank == 0
    assert batch.events == [STORED, BlockRemoved(block_hashes=[11], tier="GPU", medium="GPU")]


def test_mixed_positional_and_map_events_in_one_batch() -> None:
    batch = decode_payload(_payload(["AllBlocksCleared"], STORED_MAP, ["AllBlocksCleared"]))
    assert batch.events == [AllBlocksCleared(), STORED, AllBlocksCleared()]


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, "GPU"),
        ("GPU", "GPU"),
        ("CPU", "CPU_PINNED"),
        ("nvme", "DISK"),
        ("OBJ", "EXTERNAL"),
        ("LMCache", "LMCACHE"),
    ],
)
def test_medium_maps_to_canonical_tier_and_is_kept(medium: str | None, tier: str) -> None:
    (event,) = decode_payload(_payload(["BlockRemoved", [1], medium])).events
    assert event == BlockRemoved(block_hashes=[1], tier=tier, medium=medium)


def test_empty_batch_and_missing_rank() -> None:
    assert decode_payload(msgspec.msgpack.encode([2.0, []])) == EventBatch(seq=0, ts=2.0, events=[])
    assert decode_payload(msgspec.msgpack.encode([2, [], 3])).ts == 2.0


@pytest.mark.parametrize(
    ("event", "rank", "words"),
    [
        ({**STORED_MAP, "block_size": 0}, 0, "block_size must be positive"),
        ({**STORED_MAP, "block_size": True}, 0, "block_size must be int, got bool"),
        ({**STORED_MAP, "token_ids": [1, None]}, 0, "token_ids[1] must be int, got nil"),
        ({**STORED_MAP, "parent_block_hash": 1.5}, 0, "parent_block_hash must be int, bin or nil"),
        ({**STORED_MAP, "medium": 3}, 0, "medium must be str or nil, got int"),
        ({**STORED_MAP, "lora_id": "a"}, 0, "lora_id must be int or nil, got str"),
        ({**STORED_MAP, "block_hashes": [True]}, 0, "block_hashes[0] must be int or bin, got bool"),
        ({"block_hashes": [1]}, 0, "no 'type' key"),
        ([], 0, "empty array"),
        (["AllBlocksCleared"], -1, "dp_rank must be >= 0"),
    ],
)
def test_schema_errors_name_the_field(event: object, rank: object, words: str) -> None:
    with pytest.raises(SchemaError) as err:
        decode_payload(_payload(event, rank=rank))
    assert words in str(err.value)


# -- malformed.json ---------------------------------------------------------------------------

LAYER_ERROR = {"frames": FrameError, "msgpack": PayloadError, "schema": SchemaError}
# Unknown event types are skipped and counted, not errors (README: same resulting state).
UNKNOWN_TYPE_CASES = {"unknown_tag_map", "unknown_tag_array"}
# What each error message must name, beyond its type.
MESSAGE_NAMES = {
    "empty_payload": "truncated",
    "truncated_msgpack": "truncated",
    "truncated_float": "truncated",
    "reserved_byte": "invalid opcode",
    "trailing_bytes": "trailing",
    "payload_is_map": "payload must be an array",
    "payload_is_int": "payload must be an array",
    "batch_too_short": "1 element",
    "ts_not_number": "ts must be a number",
    "events_not_list": "events must be an array",
    "dp_rank_string": "dp_rank",
    "type_not_string": "type must be str",
    "type_invalid_utf8": "UTF-8",
    "event_not_map_or_array": "must be a map or an array",
    "huge_events_length": "truncated",
    "huge_token_ids_length": "truncated",
    "huge_str_length": "truncated",
    "negative_block_size": "block_size must be positive, got -16",
    "block_hashes_int": "block_hashes must be an array",
    "block_hashes_string": "block_hashes must be an array",
    "block_hash_float": "block_hashes[0] must be int or bin, got float",
    "block_hash_nested": "block_hashes[0] must be int or bin, got array",
    "block_hash_ext": "block_hashes[0] must be int or bin, got ext",
    "token_ids_strings": "token_ids[0] must be int, got str",
    "missing_block_hashes": "no 'block_hashes' key",
    "short_positional_event": "needs at least 4",
    "map_int_keys": "keys must be str",
    "nested_garbage": "nests deeper",
    "one_frame": "got 1",
    "two_frames": "got 2",
    "four_frames": "got 4",
    "seq_7_bytes": "got 7",
    "seq_9_bytes": "got 9",
    "seq_empty": "got 0",
}


def test_every_malformed_case_has_an_expectation() -> None:
    assert {c["id"] for c in MALFORMED} == set(MESSAGE_NAMES) | UNKNOWN_TYPE_CASES


@pytest.mark.parametrize("case", MALFORMED, ids=[c["id"] for c in MALFORMED])
def test_malformed_is_rejected_with_typed_error(case: dict[str, object]) -> None:
    msg = frames(case["frames_hex"])  # type: ignore[arg-type]
    if case["id"] in UNKNOWN_TYPE_CASES:
        batch = decode_message(msg)
        assert batch.events == [] and batch.unknown_events == 1
        return
    error = LAYER_ERROR[case["layer"]]  # type: ignore[index]
    with pytest.raises(error) as err:
        decode_message(msg)
    assert MESSAGE_NAMES[case["id"]] in str(err.value)  # type: ignore[index]
    if case["layer"] != "frames":
        # The reference path rejects it alike when called directly.
        with pytest.raises(error):
            decode_loose(msg[2])


# -- replay -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REPLAYS)
def test_replay_replies_decode(name: str) -> None:
    data = load(name)
    stream = {
        int.from_bytes(seq, "big"): (t, p) for t, seq, p in stream_frames(data["stream_file"])
    }
    with_topic = "topic" in data["reply_layout"]
    request = frames(data["request_frames_hex"])
    assert request == encode_replay_request(data["start_seq"])
    assert decode_replay_request([b"client-7", *request]) == data["start_seq"]

    replies = [decode_replay_reply(frames(r)) for r in data["reply_frames_hex"]]
    exp = data["expected"]
    assert [r.seq for r in replies] == [*exp["replayed_seqs"], END_SEQ]
    assert [r.is_end for r in replies].index(True) == exp["end_marker_index"] == len(replies) - 1
    end = replies[-1]
    assert end.payload == b"" and end.topic == (b"" if with_topic else None)
    for reply in replies[:-1]:
        topic, payload = stream[reply.seq]
        assert reply.payload == payload
        assert reply.topic == (topic if with_topic else None)
        assert decode_payload(reply.payload, seq=reply.seq, topic=topic) == decode_message(
            [topic, reply.seq.to_bytes(8, "big"), payload]
        )
    if with_topic:
        # Our publisher's replies are the same frames as vLLM >= 0.26 sends.
        for raw, reply in zip(data["reply_frames_hex"][:-1], replies):
            assert encode_replay_reply(reply.topic or b"", reply.seq, reply.payload) == frames(raw)
        assert encode_replay_end() == frames(data["reply_frames_hex"][-1])


def test_replay_frame_errors() -> None:
    seq = (5).to_bytes(8, "big")
    assert decode_replay_request([b"id", seq]) == 5
    assert decode_replay_reply([b"", seq, b"p"]) == ReplayReply(seq=5, payload=b"p", topic=None)
    assert decode_replay_reply(encode_replay_end(b"kv")) == ReplayReply(END_SEQ, b"", b"kv")
    bad: list[tuple[object, list[bytes], str]] = [
        (decode_replay_request, [b"id", b"x", seq], "delimiter frame must be empty"),
        (decode_replay_request, [b"id", b"", seq, b""], "got 4"),
        (decode_replay_request, [b"id", b"", b"\x00"], "got 1"),
        (decode_replay_reply, [b"", seq], "got 2"),
        (decode_replay_reply, [b"x", seq, b"p"], "delimiter frame must be empty"),
        (decode_replay_reply, [b"", b"t", seq[:7], b"p"], "got 7"),
    ]
    for func, msg, words in bad:
        with pytest.raises(FrameError, match=words):
            func(msg)  # type: ignore[operator]


def test_sequence_frame_bounds() -> None:
    assert encode_message(b"", 2**64 - 1, b"")[1] == b"\xff" * 8
    for call in (
        lambda: encode_message(b"", -1, b""),
        lambda: encode_message(b"", 2**64, b""),
        lambda: encode_replay_request(-1),
    ):
        with pytest.raises(ValueError):
            call()
    assert issubclass(FrameError, WireError) and issubclass(WireError, ValueError)
