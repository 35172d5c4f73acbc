"""The global prefix index: every worker's cached blocks, by router block hash and storage tier
(docs/architecture.md §3). One state object and the collaborators that receive it:

- ``types``: the vocabulary (``WorkerKey``, tier ids, ``WorkerMatch``/``MatchResult``, errors);
- ``state``: ``IndexState``, the only owner of worker tables, the tier registry and the masks;
- ``apply``: ``Applier``, events -> state, one entry point ``apply_batch`` (the subscriber task);
- ``match``: ``Matcher``, request -> per-worker matched prefix, one entry point ``match`` (read-only);
- ``evict``: ``Evictor``, the caps per rank (its KV capacity, else a default) and in all, least
  recently used first;
- ``approx``: the tree of a rank without events, from what the router sent there;
- ``rechunk``: a worker's engine blocks whose page size is not the router block size;
- ``snapshot``: the state to a file (or bytes: a peer router's warm start), and its format;
- ``snapshot_load``: the state back from those, validated and under a ``DecodeBudget``;
- ``native``: the C/Python façade of the hot loops.

``PrefixIndex`` (here) is the façade the router, the subscriber and the tools use: it holds the
state and one of each collaborator and only forwards. Single writer: only the subscriber task
calls the mutating methods; nothing here awaits.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from indexer.events import EngineHash, Event, EventBatch
from indexer.index import approx
from indexer.index.apply import Applier
from indexer.index.evict import Evictor
from indexer.index.match import Matcher
from indexer.index.snapshot import (
    SnapshotBuilder,
    encode_snapshot,
    save_snapshot,
    write_snapshot,
)
from indexer.index.snapshot_load import DecodeBudget, decode_snapshot, read_snapshot
from indexer.index.state import IndexState
from indexer.index.types import (
    MAX_UNKNOWN_MEDIUMS,
    SGLANG_ROOT_PARENT,
    IndexError_,
    MatchResult,
    RankRecord,
    SnapshotError,
    WorkerIndexStats,
    WorkerKey,
    WorkerMatch,
)

__all__ = [
    "MAX_UNKNOWN_MEDIUMS",
    "SGLANG_ROOT_PARENT",
    "DecodeBudget",
    "IndexError_",
    "MatchResult",
    "PrefixIndex",
    "SnapshotError",
    "WorkerIndexStats",
    "WorkerKey",
    "WorkerMatch",
]


class PrefixIndex:
    """Global prefix index over every worker rank. See the package docstring."""

    def __init__(self, block_size: int = 16) -> None:
        self._attach(IndexState(block_size))

    def _attach(self, state: IndexState) -> None:
        self._state = state
        self.block_size = state.block_size
        self._matcher = Matcher(state)
        self._applier = Applier(state)
        self._evictor = Evictor(state, self._matcher)
        self._applier.over_cap = self._evictor.over_cap

    # ------------------------------------------------------------------ reads

    def request_hashes(
        self,
        token_ids: Sequence[int],
        *,
        model: str = "",
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        return self._matcher.request_hashes(
            token_ids, model=model, lora_name=lora_name, cache_salt=cache_salt
        )

    def match(
        self,
        hashes: Sequence[int],
        *,
        overlay: Mapping[int, int] | None = None,
        pools: Sequence[Iterable[WorkerKey]] = (),
    ) -> MatchResult:
        """Per worker: matched prefix blocks, and how many sit on each (fastest) tier; on a
        worker with engine pages larger than a router block, whole pages only."""
        return self._matcher.match(hashes, overlay=overlay, pools=pools)

    # ----------------------------------------------------------------- writes

    def apply_batch(self, worker_id: str, batch: EventBatch, *, dp_rank: int | None = None) -> None:
        self._applier.apply_batch(worker_id, batch, dp_rank=dp_rank)

    def apply_event(self, key: WorkerKey, event: Event) -> None:
        self._applier.apply_event(key, event)

    def add_worker(self, worker_id: str, dp_rank: int = 0, *, model: str = "") -> None:
        self._state.add_worker(worker_id, dp_rank, model=model)

    def remove_worker(self, worker_id: str, dp_rank: int | None = None) -> None:
        self._state.remove_worker(worker_id, dp_rank)

    def clear_worker(self, worker_id: str, dp_rank: int) -> None:
        self._state.clear_worker(worker_id, dp_rank)

    def set_approximate(self, key: WorkerKey, on: bool = True, keep: bool = False) -> None:
        """Rank ``key`` is fed by what the router sends it (``on``) or by its events: a change
        of kind drops its entries (the other kind's are not this one's) and its cap follows.
        ``keep`` (turning approximate only): the blocks its events hold seed its tree instead,
        for a rank whose events were true but incomplete (``approx.held``)."""
        w = self._state.by_key[key]
        if w.approximate != on:
            kept = approx.held(self._state, w) if on and keep else []
            self._state.drop_entries(w)
            w.approximate = on
            if kept:
                approx.record(self._state, w, kept)
            self._evictor.refresh(w)

    def approximate(self, key: WorkerKey) -> bool:
        """Whether rank ``key`` is approximate (False for an unknown rank)."""
        w = self._state.by_key.get(key)
        return w is not None and w.approximate

    def record_sent(self, key: WorkerKey, hashes: Sequence[int]) -> int:
        """The router sent a request of router blocks ``hashes`` to approximate rank ``key``:
        they enter its tree, least recently sent forgotten past its cap (``approx``). Returns
        the blocks new there; 0 for a rank fed by events (its events say what it stores) or
        one no longer known."""
        w = self._state.by_key.get(key)
        if w is None or not w.approximate or not hashes:
            return 0
        added = approx.record(self._state, w, hashes)
        if w.cap and w.entries() > w.cap:
            self._evictor.over_cap(w)
        return added

    # -------------------------------------------------------------------- cap

    def set_cap(self, max_entries: int) -> None:
        """Cap the index at ``max_entries`` entries in all (0: no global cap)."""
        self._evictor.set_cap(max_entries)

    def set_rank_caps(self, default: int, margin: float = 1.0) -> None:
        """Cap each rank at its KV capacity times ``margin`` when known, else at ``default``
        entries (0: none). Over it, that rank's least recently used entries go (see ``evict``)."""
        self._evictor.set_rank_caps(default, margin)

    def set_rank_capacity(self, key: WorkerKey, capacity: Mapping[str, int] | None) -> bool:
        """Rank ``key``'s KV capacity, engine blocks per canonical tier (None: not known); what
        its new cap leaves over goes at once. False when the rank is not in the index."""
        w = self._state.by_key.get(key)
        if w is None:
            return False
        self._evictor.set_rank_capacity(w, capacity)
        return True

    def rank_cap(self, key: WorkerKey) -> tuple[int, str]:
        """Rank ``key``'s cap now (0: none), and whether it is its "capacity" or the "default"."""
        return self._evictor.rank_cap(self._state.by_key[key])

    def enforce_cap(self) -> int:
        """Fold recent matches into recency marks; when over the global cap, evict under it;
        the entries evicted (see ``evict``). The writer calls it between rounds."""
        return self._evictor.enforce_cap()

    @property
    def capped(self) -> bool:
        """Some cap is on: the writer calls ``enforce_cap`` every round."""
        return self._evictor.active

    @property
    def max_entries(self) -> int:
        return self._evictor.max_entries

    @property
    def evicted_entries(self) -> int:
        return self._evictor.evicted_entries

    # --------------------------------------------------------------- listings

    def workers(self) -> list[WorkerKey]:
        return self._state.workers()

    def slot(self, key: WorkerKey) -> int:
        return self._state.slot(key)

    def worker(self, key: WorkerKey) -> RankRecord:
        """One worker rank's record (KeyError when unknown)."""
        return self._state.worker(key)

    def items(self) -> list[tuple[WorkerKey, RankRecord]]:
        return self._state.items()

    def worker_stats(self, key: WorkerKey) -> WorkerIndexStats:
        st = self._state.worker_stats(key)
        st.max_entries, st.cap_source = self._evictor.rank_cap(self._state.by_key[key])
        return st

    def __len__(self) -> int:
        """Number of distinct router blocks held by at least one worker."""
        return len(self._state)

    def entries(self) -> int:
        """Number of (engine block, worker) entries."""
        return self._state.entries()

    @property
    def tier_names(self) -> list[str]:
        """Tier names by tier id: the canonical ones, then unknown mediums in arrival order."""
        return self._state.tier_names

    @property
    def unknown_tiers(self) -> dict[str, int]:
        """Tiers outside the canonical ones that were seen (scored like EXTERNAL), counted."""
        return self._state.unknown_tiers

    def holds(self, key: WorkerKey, h: int) -> bool:
        """Whether rank ``key`` holds router block ``h`` (any tier); False for an unknown rank."""
        return self._state.holds(key, h)

    def block_tiers(self, key: WorkerKey, hashes: Sequence[int]) -> list[frozenset[str]]:
        """Tiers holding each leading block of ``hashes`` on one worker, up to the first gap."""
        return self._state.block_tiers(key, hashes)

    def engine_blocks(self, key: WorkerKey) -> dict[str, set[EngineHash]]:
        """Engine hashes per tier on one worker: the listing the engines' ground-truth tests use."""
        return self._state.engine_blocks(key)

    # -------------------------------------------------------------- snapshots

    def snapshot(self, path: str | os.PathLike[str], seqs: Mapping[WorkerKey, int]) -> None:
        """Write the index and each worker's last applied seq; atomic (write + rename)."""
        write_snapshot(self._state, path, seqs)

    @classmethod
    def restore(cls, path: str | os.PathLike[str]) -> tuple[PrefixIndex, dict[WorkerKey, int]]:
        return cls._restored(*read_snapshot(path))

    def snapshot_bytes(self, seqs: Mapping[WorkerKey, int]) -> bytes:
        """What ``snapshot`` writes, as bytes (a peer router's warm start)."""
        return encode_snapshot(self._state, seqs)

    def snapshot_builder(self) -> SnapshotBuilder:
        """``snapshot_bytes`` a rank at a time, for a caller that yields between ranks."""
        return SnapshotBuilder(self._state)

    @staticmethod
    def save_snapshot_bytes(path: str | os.PathLike[str], data: bytes) -> None:
        """Write ``snapshot_bytes``'s bytes as ``snapshot`` would (atomic); it reads no index, so
        it may run in a thread."""
        save_snapshot(path, data)

    @classmethod
    def from_snapshot_bytes(
        cls, data: bytes | bytearray | memoryview, budget: DecodeBudget | None = None
    ) -> tuple[PrefixIndex, dict[WorkerKey, int]]:
        """``restore`` from ``snapshot_bytes``'s bytes, within ``budget`` (entries, deadline,
        cancel: ``indexer.index.snapshot_load``); :class:`SnapshotError` otherwise."""
        return cls._restored(*decode_snapshot(data, budget))

    @classmethod
    def _restored(
        cls, state: IndexState, seqs: dict[WorkerKey, int]
    ) -> tuple[PrefixIndex, dict[WorkerKey, int]]:
        index = cls(state.block_size)
        index._attach(state)
        return index, seqs
