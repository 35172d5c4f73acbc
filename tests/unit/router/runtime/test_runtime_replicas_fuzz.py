"""A fuzzer for replica sync's door (issue 37): a bounded random frame generator — valid
SyncMessages with extreme values, truncated msgpack, wrong types, huge array headers, non-UTF-8
strings, deep nesting, multipart frames, plain noise — sent from a real ZMQ PUB to a real
``ReplicaSync``. The task never dies (a well-behaved peer is heard afterwards, and the replica
still places), every frame is accounted for exactly once (applied, or dropped under a reason),
and remote state stays within its budgets. ``KVROUTER_FUZZ_SEED`` replays another seed."""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import pytest
import zmq
from sync_peers import BS, raw_pub, subscribed, sync

from router.placement import RemoteEvent
from router.runtime.replicas.origins import MAX_PEERS
from router.runtime.replicas.sync import SYNC_DROP_REASONS
from router.runtime.replicas.wire import MAX_EVENTS, VERSION
from tests.waiting import wait_for

SEED = int(os.environ.get("KVROUTER_FUZZ_SEED", "37"))
FRAMES = 4000
MAX_HASHES = 1024  # (small: the budgets below are reached within the run)
U64 = (1 << 64) - 1
enc = msgspec.msgpack.encode


def _int(r: random.Random) -> int:
    return r.choice([0, 1, -1, 1023, 1024, (1 << 63) - 1, 1 << 63, U64, -(1 << 63),
                     r.getrandbits(64), -r.getrandbits(63)])  # fmt: skip


def _placed(r: random.Random, ticket: int) -> list:
    n = r.choice([0, 1, 7, MAX_HASHES, MAX_HASHES + 1, r.randrange(2 * MAX_HASHES)])
    hashes = [_int(r) for _ in range(n)]
    matched = r.choice([0, n, n + 1, r.randrange(n + 1)])
    return [1, ticket, r.choice(["a", "b", "nope", "x" * 128]), r.choice([0, 1, 1023]), hashes,
            r.choice([0.0, 1.0, 1e9, float(n)]), matched]  # fmt: skip


def _event(r: random.Random) -> list:
    t = r.choice([0, 1, 5, (1 << 63) - 1, r.randrange(64)])
    return r.choice([lambda: _placed(r, t), lambda: [2, t], lambda: [3, t]])()


def valid(r: random.Random) -> bytes:
    """A message the decoder takes (its values at their bounds)."""
    origin = r.choice(["p", "q", "o" * 64, f"origin-{r.randrange(2 * MAX_PEERS)}"])
    events = [_event(r) for _ in range(r.choice([0, 1, 3, 40]))]
    seq = r.choice([0, 1, 2, r.randrange(1 << 20), (1 << 63) - 1])
    return enc([VERSION, origin, seq, BS, events])


def truncated(r: random.Random) -> bytes:
    f = valid(r)
    return f[: r.randrange(len(f))]


def wrong_types(r: random.Random) -> bytes:
    m = msgspec.msgpack.decode(valid(r))
    i = r.randrange(5)
    m[i] = r.choice(["x", 1.5, None, [], {}, b"\x00", True, -1, U64])
    return enc(m)


def huge_header(r: random.Random) -> bytes:
    """An array or string header that claims far more than follows (or far more events)."""
    return r.choice([
        b"\x95\x01\xa1p\x00\x10\xdd" + struct.pack(">I", 0xFFFFFFFF),
        b"\xdd" + struct.pack(">I", 0xFFFFFFFF),
        b"\x95\x01\xdb" + struct.pack(">I", 0xFFFFFFF0) + b"p",
        enc([VERSION, "p", 0, BS, [[3, 1]] * (MAX_EVENTS + 1)]),
    ])  # fmt: skip


def not_utf8(r: random.Random) -> bytes:
    return r.choice([bytes.fromhex("9501a1ff"), b"\x95\x01\xa2\xc3\x28\x00\x10\x90",
                     b"\x95\x01\xa1p\x00\x10\x91\x97\x01\x01\xa1\xff\x00\x90\xcb" + bytes(8) + b"\x00"])  # fmt: skip


def deep(r: random.Random) -> bytes:
    depth = r.choice([100, 10_000, 100_000])
    return b"\x91" * depth + b"\x90"


def noise(r: random.Random) -> bytes:
    return r.randbytes(r.randrange(1, 512))


KINDS: list[Callable[[random.Random], bytes]] = [
    valid,
    valid,
    valid,
    truncated,
    wrong_types,
    huge_header,
    not_utf8,
    deep,
    noise,
]


def frames(r: random.Random) -> list[list[bytes]]:
    """One message: mostly one frame; sometimes several (a multipart message is malformed)."""
    parts = [r.choice(KINDS)(r)]
    if r.random() < 0.05:
        parts += [r.choice(KINDS)(r) for _ in range(r.randrange(1, 3))]
    return [parts]


def accounted(s) -> int:  # type: ignore[no-untyped-def]
    """Messages applied or dropped by the sync (each counted once, under one reason)."""
    return s.received + sum(s.dropped[k] for k in SYNC_DROP_REASONS if k != "send_failed")


async def test_fuzzed_frames_never_kill_sync_and_each_is_counted(tmp_path: Path) -> None:
    r = random.Random(SEED)
    # (frames stay under max_message_bytes: 40 events of 2,048 hashes are 737 KB at most; a
    # larger one is cut off by libzmq, which test_replicas_sync covers)
    budgets = {"max_peer_state_mib": 2.0, "max_remote_state_mib": 4.0, "max_message_bytes": 1 << 20}
    a = sync(heartbeat_s=0.05, peer_timeout_s=60.0, max_hashes=MAX_HASHES, **budgets)
    good = sync(sync_bind=f"ipc://{tmp_path}/good.sock", heartbeat_s=0.05)
    ctx: zmq.Context = zmq.Context()
    pub, ep = raw_pub(ctx, xpub=True)
    await a.start()
    await good.start()
    try:
        a.set_peers([ep])

        await wait_for(lambda: subscribed(pub), 10, "a subscribed to the fuzzing peer")
        base = accounted(a)
        sent = 0
        remote = a.placer.remote
        peak = 0
        for _ in range(FRAMES // 50):  # in batches within the SUB's queue
            for _ in range(50):
                for parts in frames(r):
                    pub.send_multipart(parts)
                    sent += 1
            await wait_for(lambda n=sent: accounted(a) - base == n, 10, "a batch accounted")
            assert a._task is not None and not a._task.done()
            assert remote.bytes <= remote.max_bytes and len(a.origins) <= MAX_PEERS
            peak = max(peak, remote.bytes)
        assert a.dropped["malformed"] > FRAMES // 10 and a.received > FRAMES // 10
        assert peak > 0 and all(remote.origin_bytes(o) <= remote.max_origin_bytes
                                for o in remote.origins())  # fmt: skip
        assert good.endpoint
        a.set_peers([ep, good.endpoint])
        await wait_for(lambda: good.origin in set(a.origins), 10, "a well-behaved peer heard")
        d = a.placer.place(list(range(3000, 3000 + 4 * BS)))  # and it still places
        assert d.order
    finally:
        ctx.destroy(linger=0)
        await a.aclose()
        await good.aclose()


async def test_a_defect_in_applying_is_counted_and_sync_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No frame found by the fuzzer makes applying raise; should a defect do so, the message is
    dropped (``error``), its traceback logged, and the task reads on (before, it died silently).
    The defect is injected: RemoteTickets.apply raises once."""
    a = sync(heartbeat_s=0.05)
    ctx: zmq.Context = zmq.Context()
    pub, ep = raw_pub(ctx, xpub=True)
    await a.start()
    real = a.placer.remote.apply

    def defect(origin: str, events: Sequence[RemoteEvent]) -> None:
        a.placer.remote.apply = real  # type: ignore[method-assign]
        raise RuntimeError("an injected defect")

    try:
        a.set_peers([ep])
        await wait_for(lambda: subscribed(pub), 10, "a subscribed")
        a.placer.remote.apply = defect  # type: ignore[method-assign]
        pub.send(enc([VERSION, "p", 0, BS, [[1, 1, "a", 0, [1, 2], 2.0, 0]]]))
        pub.send(enc([VERSION, "p", 1, BS, [[1, 2, "a", 0, [3, 4], 2.0, 0]]]))
        await wait_for(lambda: len(a.placer.remote) == 1, 10, "the next message applied")
        assert a.dropped["error"] == 1 and a._task is not None and not a._task.done()
        assert "applying a peer's message failed" in caplog.text and "injected" in caplog.text
    finally:
        ctx.destroy(linger=0)
        await a.aclose()
