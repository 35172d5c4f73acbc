"""A snapshot's ranks (``Subscriber.restore_seqs``: a peer's warm start or the local file) and
how far the subscriber trusts them (docs/architecture.md §9, issue 37 item 7).

A snapshot's entries of a rank are a claim about a worker's cache that only its publisher can
back, so a restored rank is kept only as far as its stream proves it:

- a rank its worker does not have (a ``dp_rank`` beyond the worker's ``dp_ranks``) is dropped
  when the worker is added: nothing would ever correct it, and the metrics, which list the
  configured ranks, would not show it;
- a rank the stream cannot check is cleared and joins like a new one: its worker has no
  replay endpoint, or the snapshot has no seq (or no batch ``ts``) for it;
- every other rank resumes reconciling (:meth:`Replays.resume`): rebuilt from the publisher's
  whole stream when it still holds seq 0, else kept once the batch of its seq comes back with
  the same ``ts`` (another process: cleared and replayed, as before).

Ranks dropped or cleared here are counted by reason (``dropped``), and the rebuilt ones by the
replays; ``kvrouter_snapshot_ranks_dropped`` shows both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from indexer.index.types import WorkerKey
from indexer.subscriber.records import UNANCHORED, WorkerEndpoint, WorkerRank, log
from indexer.subscriber.replay import Replays
from indexer.subscriber.writer import IndexWriter

if TYPE_CHECKING:
    from indexer.index import PrefixIndex

__all__ = ["RestoredRanks"]


class RestoredRanks:
    """The restored seqs of ranks not added yet, and the rules above; on the subscriber task."""

    def __init__(self, index: PrefixIndex, writer: IndexWriter, replays: Replays) -> None:
        self._index = index
        self._writer = writer
        self._replays = replays
        #: resume points of ranks whose worker is not added yet
        self.seqs: dict[WorkerKey, int] = {}
        #: ranks dropped or cleared, by reason
        self.dropped: dict[str, int] = {}

    def counts(self) -> dict[str, int]:
        """Restored ranks dropped, cleared or rebuilt, by reason."""
        return {**self.dropped, "rebuilt": self._replays.rebuilt}

    def held(self, worker_id: str) -> set[WorkerKey]:
        """The ranks of ``worker_id`` the index holds before the worker is added: a snapshot's
        (the subscriber, the index's only writer, has not added them)."""
        return {k for k in self._index.workers() if k[0] == worker_id}

    def drop_unconfigured(self, ep: WorkerEndpoint, held: set[WorkerKey]) -> None:
        """Drop the held ranks of ``ep``'s worker beyond its ``dp_ranks``."""
        for key in sorted(held):
            if key[1] >= ep.dp_ranks:
                self._index.remove_worker(*key)
                self.seqs.pop(key, None)
                self._count("unconfigured_rank")
                log.warning(
                    "snapshot rank %d of worker %s dropped: the worker has %d dp ranks",
                    key[1],
                    key[0],
                    ep.dp_ranks,
                )

    def claim(self, r: WorkerRank, held: bool) -> None:
        """A rank of a worker being added: resume it from its restored seq when it has one."""
        seq = self.seqs.pop(r.key, None)
        if seq is not None or held:
            self.resume(r, seq, join=True)
        elif r.replay_ep is not None:
            self._replays.resume(r, join=True)
        else:
            r.stats.replay_done = True

    def resume(self, r: WorkerRank, seq: int | None, *, join: bool) -> None:
        """Resume ``r``, whose index entries came from a snapshot with resume point ``seq``."""
        ts = getattr(seq, "ts", None)
        if seq is None or ts is None or r.replay_ep is None:
            if r.replay_ep is None:
                why = "no replay endpoint"
            elif seq is None:
                why = "no seq to resume from"
            else:
                why = "no batch ts to check the publisher by"
            self._writer.clear(r)
            self._count("unverifiable")
            log.warning(
                "worker %s rank %d: snapshot entries cleared (%s): rebuilt from its events",
                r.worker_id,
                r.rank,
                why,
            )
            r.last, r.last_ts = UNANCHORED, None
            if r.replay_ep is not None:
                self._replays.resume(r, join=join)
            elif join:
                r.stats.replay_done = True
            return
        r.last, r.last_ts = int(seq), ts
        self._replays.resume(r, join=join, reconcile=True)

    def unverifiable(self, worker_id: str, held: set[WorkerKey]) -> None:
        """The worker has no events: nothing can check its held ranks, whose entries go when
        its ranks turn approximate (``PrefixIndex.set_approximate``)."""
        self.forget(worker_id)
        for key in sorted(held):
            self._count("unverifiable")
            log.warning(
                "worker %s rank %d: snapshot entries cleared (it publishes no events)", *key
            )

    def forget(self, worker_id: str) -> None:
        for key in [k for k in self.seqs if k[0] == worker_id]:
            del self.seqs[key]

    def _count(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
