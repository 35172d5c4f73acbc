"""Replica sync's authentication and encryption: ZMQ CURVE (CurveZMQ) from the peer key.

Every replica derives the same CURVE key pair from ``replicas.peer_key_file``
(:meth:`router.runtime.replicas.peerkey.PeerKey.curve`):

- the PUB is the CURVE server (that secret key); a ZAP handler — pyzmq's
  :class:`zmq.auth.asyncio.AsyncioAuthenticator`, on the sync's own loop and context — admits
  only a client that presents the shared public key, so whoever lacks the secret cannot
  subscribe (libzmq admits any key when no ZAP handler runs: it is what makes this an allow
  list of one);
- each SUB is a CURVE client with the same pair and ``curve_serverkey`` = the shared public key:
  a publisher without the secret cannot finish the handshake, so it cannot inject.

Traffic is then encrypted both ways. With a key it applies to every transport, ``ipc://`` of
``--processes``' siblings too: one rule, and the siblings' directory (0700) stops being the only
guard. Without a key (``trusted_network``, or ipc alone) the sockets run ZMQ's NULL mechanism.

A handshake that fails shows on the sockets' monitors (:func:`handshake_failure` names why),
counted by :class:`router.runtime.replicas.links.Links`.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator

from router.runtime.replicas.peerkey import PeerKey

__all__ = ["HANDSHAKE_EVENTS", "HANDSHAKE_REASONS", "Curve", "handshake_failure"]

#: why a sync handshake failed: ``auth``, the publisher's ZAP handler refused the subscriber's
#: key (another fleet's, or made up); ``crypto``, the peer's CURVE keys do not match ours (it
#: holds another peer key); ``mechanism``, one side runs CURVE, the other none (a peer with no
#: peer key, or a stranger); ``other``, what libzmq does not detail
HANDSHAKE_REASONS = ("auth", "crypto", "mechanism", "other")
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
#: the ZAP domain of sync's PUB (a ZAP request names it; any value enables ZAP for the socket)
_DOMAIN = "kvrouter-sync"


def handshake_failure(event: int, value: int) -> str | None:
    """The reason (:data:`HANDSHAKE_REASONS`) of a monitor event that is a failed handshake;
    None for any other event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "auth"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "mechanism"
        if value in (zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE):
            return "crypto"
        return "other"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "other"
    return None


class _OneKey:
    """The ZAP handler's credentials provider: the shared public key and no other."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._public)


class Curve:
    """The shared key pair and the ZAP handler of one :class:`ReplicaSync`'s context."""

    def __init__(self, key: PeerKey) -> None:
        self.public, self._secret = key.curve()
        self._auth: AsyncioAuthenticator | None = None

    def start(self, ctx: zmq.Context[Any]) -> None:
        """Start the ZAP handler on ``ctx`` (before the PUB binds: every handshake asks it)."""
        auth = AsyncioAuthenticator(ctx, log=logging.getLogger("kvrouter.replicas.zap"))
        auth.start()
        auth.configure_curve_callback(_DOMAIN, _OneKey(self.public))
        self._auth = auth

    def server(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (the PUB, before it binds) a CURVE server behind the ZAP handler."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, _DOMAIN)

    def client(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (the SUB, before it connects) a CURVE client of the shared key."""
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public)

    def stop(self) -> None:
        """Stop the ZAP handler (before its context is destroyed)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
