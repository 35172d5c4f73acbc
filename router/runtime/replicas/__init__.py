"""Router replicas that place as one (docs/architecture.md §9), as glue around the pure
placement core:

- ``sync``: :class:`ReplicaSync`, the placer's listener that publishes its tickets' life on a
  ZMQ PUB, and the one task that receives the peers' and applies them as remote tickets;
- ``wire``: the one message shape (msgspec, msgpack) and its bounds;
- ``curve``: CURVE on every sync socket with a peer key, the ZAP handler, handshake failures;
- ``links``: the SUB's connections and both sockets' monitors (redial, refused handshakes);
- ``origins``: the peer table: what a message's origin and seq mean, its bound;
- ``budget``: the sync task's budget per turn, the queues' bound in MiB;
- ``peers``: peers from the router's own pods (``replicas.discovery``);
- ``warm``: a starting replica's index from a peer's snapshot, else a cold start;
- ``peerkey``: the shared peer key (``replicas.peer_key_file``) and what it derives: sync's
  CURVE key pair, the snapshot token;
- ``errors``: the package's exceptions.

``kvrouter serve --processes N`` (:mod:`router.edge.processes`) runs N replicas on one port,
synced through this over ``ipc://``.
"""

from router.runtime.replicas.errors import ReplicaError, SyncBindError, WarmStartError
from router.runtime.replicas.peerkey import PeerKey, peer_key
from router.runtime.replicas.peers import warm_urls
from router.runtime.replicas.sync import ReplicaSync
from router.runtime.replicas.warm import (
    SNAPSHOT_PATH,
    SNAPSHOT_TYPE,
    WarmIndex,
    warm_index,
)

__all__ = [
    "SNAPSHOT_PATH",
    "SNAPSHOT_TYPE",
    "PeerKey",
    "ReplicaError",
    "ReplicaSync",
    "SyncBindError",
    "WarmIndex",
    "WarmStartError",
    "peer_key",
    "warm_index",
    "warm_urls",
]
