"""The ZMQ subscriber: the event plane's edge and the prefix index's only writer
(docs/architecture.md §4). ``Subscriber`` (``task``) composes the parts:

- ``records``: endpoints, exported stats, the per-rank state, the subscriber's logger;
- ``sockets``: the sockets, their registration with the asyncio loop, the one drain loop;
- ``stream``: the live stream's rules (order, gaps, restarts, connection events);
- ``replay``: replays from a publisher's buffer, and telling a new publisher process;
- ``writer``: the writes to the index (apply, clear, drop) and their counters.
"""

from indexer.subscriber.records import SubscriberError, WorkerEndpoint, WorkerStats, rank_endpoint
from indexer.subscriber.task import Subscriber

__all__ = ["Subscriber", "SubscriberError", "WorkerEndpoint", "WorkerStats", "rank_endpoint"]
