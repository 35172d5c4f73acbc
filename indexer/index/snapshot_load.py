"""Loading a snapshot (:mod:`indexer.index.snapshot`'s format) from bytes a peer or a file gave,
validated and under a budget (docs/architecture.md §9, issue 37 items 7 and 9).

A peer's snapshot is input like any other: a router that warm-starts from it must neither crash,
nor stall, nor hold what no engine could have sent. So:

- Validated at decode: every field in its range (ranks, seqs, timestamps, tier masks, page
  sizes, hash widths), the three per-rank columns of one length, no engine block twice in a
  rank and no rank twice, a duplicate-store record only for a block and tier the rank holds
  (its count clamped to ``MAX_RESTORED_DUPS``: fewer counted copies only make the index forget
  a block early, a miss, where a huge count would pin it for good), covers of at most
  ``block_size + 1`` distinct engine blocks (a list that repeats one made tier changes
  quadratic), at most ``MAX_RANKS`` ranks. Anything else is a :class:`SnapshotError`.
- Decoded a rank at a time: the header is decoded with each rank left encoded (zero-copy
  ``msgspec.Raw`` views of the body); each rank's columns are counted from their msgpack array
  headers *before* they are decoded, against the budget's entries; the decoded columns of one
  rank at most exist at once.
- Under a :class:`DecodeBudget`: a number of entries (engine blocks, re-chunked blocks, covers
  and duplicate records, all ranks together) and a deadline, with a cancel flag another thread
  may set. Both are checked between ranks and every ``CHECK_EVERY`` entries while a rank is
  built, so a decode in a thread really stops (a ``SnapshotError``) soon after its warm start
  gave up, instead of building an index nobody will use.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from indexer.events import ResumePoint
from indexer.hashing import HASH_VERSION
from indexer.index.rechunk import RechunkTable
from indexer.index.snapshot import FORMAT
from indexer.index.state import IndexState
from indexer.index.types import MAX_TIERS, SnapshotError, WorkerKey

__all__ = [
    "CHECK_EVERY",
    "MAX_RANKS",
    "MAX_RESTORED_DUPS",
    "DecodeBudget",
    "decode_snapshot",
    "read_snapshot",
]

#: ranks in one snapshot: every rank takes a bit of each router block's presence mask, so a
#: snapshot of made-up ranks would widen every mask (a few hundred workers of 8 ranks fit)
MAX_RANKS = 4096
#: stores beyond the first a restored block keeps per tier (see the module docstring)
MAX_RESTORED_DUPS = 8
#: entries built between two looks at the budget's deadline and cancel flag (~50 ms)
CHECK_EVERY = 1 << 15

_EH = int | Annotated[bytes, msgspec.Meta(max_length=64)]
#: a router hash (indexer.hashing: 64 bits, unsigned; msgpack holds no wider int): the C
#: presence table takes only these (a negative one raised OverflowError past the decoder)
_RH = Annotated[int, msgspec.Meta(ge=0)]
_Mask = Annotated[int, msgspec.Meta(ge=1, lt=1 << MAX_TIERS)]
_Small = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]


class _Head(msgspec.Struct):
    format: str
    hash_version: int
    block_size: Annotated[int, msgspec.Meta(ge=1, lt=1 << 16)]
    tiers: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=MAX_TIERS)
    ]
    workers: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_RANKS)]


_EMPTY = msgspec.Raw(b"\x90")  # an empty msgpack array


class _RankHead(msgspec.Struct):
    """One rank of the snapshot with its columns left encoded (counted before decoded)."""

    worker_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    dp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
    model: Annotated[str, msgspec.Meta(max_length=1024)]
    seq: Annotated[int, msgspec.Meta(ge=0)] | None
    engine_hashes: msgspec.Raw
    router_hashes: msgspec.Raw
    tiers: msgspec.Raw
    rechunk: msgspec.Raw = _EMPTY
    cover: msgspec.Raw = _EMPTY
    ts: float | None = None
    dups: msgspec.Raw = _EMPTY
    page: _Small = 0
    partial_groups: Annotated[list[_Small], msgspec.Meta(max_length=256)] = []


class _RBlock(msgspec.Struct, array_like=True):
    engine_hash: _EH
    parent: _EH | None
    tiers: _Mask
    end: Annotated[int, msgspec.Meta(ge=0)]
    state: _RH
    tail: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=1 << 16)]


_head = msgspec.msgpack.Decoder(_Head)
_rank = msgspec.msgpack.Decoder(_RankHead)
_ehs = msgspec.msgpack.Decoder(list[_EH])
_rhs = msgspec.msgpack.Decoder(list[_RH])
_masks = msgspec.msgpack.Decoder(list[_Mask])
_rblocks = msgspec.msgpack.Decoder(list[_RBlock])
_covers = msgspec.msgpack.Decoder(list[tuple[_RH, list[_EH]]])
_dups = msgspec.msgpack.Decoder(
    list[
        tuple[
            _EH,
            Annotated[int, msgspec.Meta(ge=0, lt=MAX_TIERS)],
            Annotated[int, msgspec.Meta(ge=1)],
        ]
    ]
)


class DecodeBudget:
    """What one decode may take: ``max_entries`` entries (0: any number) and time until
    ``deadline`` (``time.monotonic``; None: none); :meth:`cancel` (from any thread) stops it at
    its next check. Shared with the thread that decodes; ``entries`` counts what it took."""

    def __init__(self, max_entries: int = 0, deadline: float | None = None) -> None:
        self.max_entries = max_entries
        self.deadline = deadline
        self.entries = 0
        # a plain flag: one thread sets it, the decoding one reads it (a bool's store is atomic
        # under the GIL, and the index imports no threading: the placement core reaches it)
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def check(self, what: str) -> None:
        """:class:`SnapshotError` once cancelled or past the deadline."""
        if self.cancelled:
            raise SnapshotError(f"{what}: decode cancelled")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise SnapshotError(f"{what}: decode ran past its deadline")

    def take(self, n: int, what: str) -> None:
        """Count ``n`` more entries: :class:`SnapshotError` past ``max_entries``."""
        self.entries += n
        if self.max_entries and self.entries > self.max_entries:
            raise SnapshotError(
                f"{what}: over its budget of {self.max_entries:,} entries (raise "
                "max_index_entries to take a larger index)"
            )


def read_snapshot(
    path: str | os.PathLike[str], budget: DecodeBudget | None = None
) -> tuple[IndexState, dict[WorkerKey, int]]:
    """A new index state from a snapshot file, and each worker rank's resume point."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SnapshotError(f"cannot read index snapshot {os.fspath(path)!r}: {exc}") from exc
    return decode_snapshot(data, budget, what=f"index snapshot {os.fspath(path)!r}")


def decode_snapshot(
    data: bytes | bytearray | memoryview,
    budget: DecodeBudget | None = None,
    *,
    what: str = "index snapshot",
) -> tuple[IndexState, dict[WorkerKey, int]]:
    """A new index state from snapshot bytes (``encode_snapshot``'s), and each worker rank's
    resume point; :class:`SnapshotError` for anything else, or past ``budget``."""
    budget = budget or DecodeBudget()
    head = _decode(_head, data, what)
    if head.format != FORMAT:
        raise SnapshotError(f"snapshot format {head.format!r} is not {FORMAT!r}")
    if head.hash_version != HASH_VERSION:
        raise SnapshotError(
            f"snapshot router hash version {head.hash_version} != {HASH_VERSION}; rebuild from events"
        )
    if len(set(head.tiers)) != len(head.tiers):
        raise SnapshotError(f"{what}: a tier named twice in {head.tiers}")
    index = IndexState(head.block_size)
    for name in head.tiers:
        index.tier_id(name)
    index.unknown_tiers.clear()
    ntiers = len(index.tier_names)  # (the canonical ones at least, in their order)
    if index.tier_names[: len(head.tiers)] != head.tiers:
        raise SnapshotError(f"{what}: tiers {head.tiers} are not in the index's order")
    seqs: dict[WorkerKey, int] = {}
    for raw in head.workers:
        budget.check(what)
        rh = _decode(_rank, raw, what)
        key = (rh.worker_id, rh.dp_rank)
        if key in index.by_key:
            raise SnapshotError(f"{what}: rank {key} twice")
        where = f"{what}: rank {key}"
        counts = [_length(c, where) for c in (rh.engine_hashes, rh.rechunk, rh.cover, rh.dups)]
        budget.take(sum(counts), where)
        _load_rank(index, rh, budget, where, ntiers)
        if rh.seq is not None:
            if rh.ts is not None and not math.isfinite(rh.ts):
                raise SnapshotError(f"{where}: ts {rh.ts}")
            seqs[key] = ResumePoint(rh.seq, rh.ts)
    return index, seqs


def _load_rank(
    index: IndexState, rh: _RankHead, budget: DecodeBudget, where: str, ntiers: int
) -> None:
    engine = _decode(_ehs, rh.engine_hashes, where)
    router = _decode(_rhs, rh.router_hashes, where)
    masks = _decode(_masks, rh.tiers, where)
    if not len(engine) == len(router) == len(masks):
        raise SnapshotError(
            f"{where}: {len(engine)} engine hashes, {len(router)} router hashes, {len(masks)} tiers"
        )
    index.add_worker(rh.worker_id, rh.dp_rank, model=rh.model)
    w = index.by_key[(rh.worker_id, rh.dp_rank)]
    if rh.page:
        index.set_page(w, rh.page)
    w.partial_groups = set(rh.partial_groups)
    top = 1 << ntiers
    present, bit, set_mask = index.present, w.bit, index.set_mask
    twice: set[int] = set()  # router blocks this rank reaches from several engine blocks (rare)
    for i, (e, h, m) in enumerate(zip(engine, router, masks)):
        if not i % CHECK_EVERY:
            budget.check(where)
        if m >= top:
            raise SnapshotError(f"{where}: tier mask {m} names a tier beyond {ntiers}")
        w.table[e] = h
        if m != 1:
            w.emask[e] = m
        if present.get(h, 0) & bit:
            twice.add(h)
        else:  # (no per-block group is built: the common case costs no more than the table)
            set_mask(w, h, 0, m)
    if len(w.table) != len(engine):
        raise SnapshotError(f"{where}: {len(engine) - len(w.table)} engine blocks listed twice")
    for m, n in Counter(masks).items():
        for t in range(ntiers):
            if m >> t & 1:
                w.tier_counts[t] += n
    del engine, router, masks
    if twice:
        _load_multi(index, w, twice)
    for e, t, n in _decode(_dups, rh.dups, where):
        if not w.emask.get(e, 1 if e in w.table else 0) >> t & 1:
            raise SnapshotError(f"{where}: duplicate stores of a block not held on tier {t}")
        w.dups.setdefault(e, {})[t] = min(n, MAX_RESTORED_DUPS)
    blocks = _decode(_rblocks, rh.rechunk, where)
    if blocks:
        _load_rechunk(index, w, blocks, _decode(_covers, rh.cover, where), budget, where, top)


def _load_multi(index: IndexState, w: Any, twice: set[int]) -> None:
    """The groups of the router blocks ``w`` reaches from several engine blocks: their masks
    were set from their first engine block, now from all."""
    for e, h in w.table.items():
        if h in twice:
            w.multi.setdefault(h, {})[e] = w.emask.get(e, 1)
    for h, group in w.multi.items():
        first = next(iter(group.values()))
        mask = 0
        for m in group.values():
            mask |= m
        index.set_mask(w, h, first, mask)


def _load_rechunk(
    index: IndexState,
    w: Any,
    blocks: Sequence[_RBlock],
    covers: Sequence[tuple[int, list[Any]]],
    budget: DecodeBudget,
    where: str,
    top: int,
) -> None:
    rc = RechunkTable(index, w)
    w.rechunk = rc
    bs = index.block_size
    for i, rb in enumerate(blocks):
        if not i % CHECK_EVERY:
            budget.check(where)
        if rb.tiers >= top or len(rb.tail) > bs or rb.engine_hash in rc.blocks:
            raise SnapshotError(f"{where}: re-chunked block {rb.engine_hash!r} malformed")
        rc.load_block(rb.engine_hash, rb.parent, rb.tiers, rb.end, rb.state, tuple(rb.tail))
    # a router block is covered by at most block_size + 1 distinct engine blocks (pages of one
    # token or more); a peer's snapshot that lists more, or one twice, would make every tier
    # change of that block walk its list once per entry (quadratic)
    most = bs + 1
    seen: set[int] = set()
    for i, (h, cov) in enumerate(covers):
        if not i % CHECK_EVERY:
            budget.check(where)
        if len(cov) > most or len(set(cov)) != len(cov) or h in seen:
            raise SnapshotError(
                f"{where}: router block {h} covered by {len(cov)} engine blocks "
                f"({len(set(cov))} distinct; at most {most}), or twice"
            )
        seen.add(h)
        rc.load_cover(h, list(cov))


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: Any, what: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # (msgspec's, for bad UTF-8)
        raise SnapshotError(f"cannot read {what}: {exc}") from exc


def _length(raw: msgspec.Raw, where: str) -> int:
    """The length a msgpack array declares in its header, read without decoding it."""
    b = memoryview(raw)
    if len(b) >= 1 and 0x90 <= b[0] <= 0x9F:
        return b[0] & 0x0F
    if len(b) >= 3 and b[0] == 0xDC:
        return int.from_bytes(b[1:3], "big")
    if len(b) >= 5 and b[0] == 0xDD:
        return int.from_bytes(b[1:5], "big")
    raise SnapshotError(f"{where}: a column is not an array")
