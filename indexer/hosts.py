"""Whether a bind address is a wildcard (every interface), the one home of that idea.

Here, at the bottom of the import graph, because both sides meet such addresses: the router in a
publisher's ``/kv_event_sources`` (``tcp://*:5557``: use the pod's IP instead), its own sockets
(reach them on loopback), and the engine's block endpoint (advertise a concrete address instead).
"""

from __future__ import annotations

import ipaddress

__all__ = ["WILDCARD_HOSTS", "is_wildcard"]

#: what a wildcard bind is spelled as: ZMQ's ``*``, IPv4's and IPv6's any-address (bracketed as
#: in a URL too), and the empty host that asyncio and socket bind on every interface
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def is_wildcard(host: str) -> bool:
    """``host`` binds every interface: no peer can connect to it as an address (any spelling of
    the unspecified address too: ``0::0``)."""
    if host in WILDCARD_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name, or bracketed
        return False
