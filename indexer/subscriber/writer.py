"""What the subscriber does to one worker rank's entries in the index: apply a batch, clear them
(a new publisher process), drop them (events lost for good: the rank turns untrusted), and count
what could not be applied. The stream rules and the replays both write through one
``IndexWriter``, on the subscriber task, which is the index's only writer.

Trust rule: a rank whose entries were dropped because events were lost (a gap replay could not
close, a replay timeout) is ``trusted=False`` until it applies, in order, a live batch newer than
every batch seen when the entries were dropped (``indexer.subscriber.stream``). A publisher
restart clears the entries too but leaves the rank trusted: its cache really is empty.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from indexer.events import EventBatch
from indexer.index.types import WorkerKey
from indexer.subscriber.records import WorkerRank, log, log_limited

if TYPE_CHECKING:
    from indexer.index import PrefixIndex

__all__ = ["IndexWriter"]


class IndexWriter:
    """The subscriber's writes to ``index``, per worker rank, with their counters."""

    def __init__(
        self, index: PrefixIndex, on_applied: Callable[[WorkerKey], None] | None = None
    ) -> None:
        self.index = index
        self.on_applied = on_applied

    def apply(self, r: WorkerRank, batch: EventBatch) -> None:
        """Apply ``batch`` (already accepted by the sequence rules; ``r.last`` is its seq)."""
        st = r.stats
        r.last_ts = batch.ts
        try:
            self.index.apply_batch(r.worker_id, batch, dp_rank=r.rank)
        except Exception as exc:
            self.apply_failed(r, batch, exc)
        else:
            self.applied(r)
        st.messages += 1
        if batch.unknown_events:
            st.unknown_events += batch.unknown_events

    def applied(self, r: WorkerRank) -> None:
        """Tell ``on_applied`` that batches were applied to ``r`` (once per drain on the hot
        path, which applies without this writer)."""
        if self.on_applied is not None:
            try:
                self.on_applied(r.key)
            except Exception as exc:  # (a bug of the listener's: the stream goes on)
                log_limited(r, logging.WARNING, "on_applied failed: %r", exc)

    def apply_failed(self, r: WorkerRank, batch: EventBatch, exc: Exception) -> None:
        """The index raised on ``batch`` (a bug): counted and skipped, the stream goes on."""
        r.stats.apply_errors += 1
        log_limited(r, logging.WARNING, "index rejected batch seq %d: %r", batch.seq, exc)

    def clear(self, r: WorkerRank) -> None:
        r.clears += 1
        try:
            self.index.clear_worker(r.worker_id, r.rank)
        except Exception as exc:
            r.stats.apply_errors += 1
            log_limited(r, logging.WARNING, "index clear failed: %r", exc)

    def drop(self, r: WorkerRank, why: str) -> None:
        """Events were lost for good: drop the rank's entries until fresh events rebuild them."""
        self.clear(r)
        st = r.stats
        st.replay_failures += 1
        st.trusted = False
        r.fast = False
        r.trust_after = max(r.live_last, r.last)
        log.warning("worker %s rank %d entries dropped: %s", r.worker_id, r.rank, why)

    def malformed(self, r: WorkerRank, exc: Exception) -> None:
        r.stats.malformed += 1
        log_limited(r, logging.DEBUG, "malformed message dropped: %s", exc)
