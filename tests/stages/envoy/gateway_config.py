"""The Envoy config the stage runs: ``deploy/gateway/envoy.yaml`` itself (one source), made
loopback for this run by :func:`kvrouter.gateway.render` (ports, addresses, the access log's
path), plus one test-only filter in front of ext_proc that turns the request header ``x-subset``
into the subset hint (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``), the
way a gateway's own filter would set it. Everything else (the ext_proc filter, its processing
modes, the ORIGINAL_DST cluster, the timeouts, the access log format) is the committed file's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrouter.gateway import EXT_PROC, connection_manager, render

SUBSET_HEADER = "x-subset"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

__all__ = ["SUBSET_HEADER", "for_test"]


def for_test(source: dict[str, Any], *, epp_port: int, access_log: Path) -> dict[str, Any]:
    """``source`` (the committed config) on loopback: listener and admin on port 0 (the bound
    ports are read back from the admin API), the EPP on ``epp_port``, the access log in a file,
    and the ``x-subset`` header turned into the subset hint before ext_proc sees the request."""
    config = render(source, epp=("127.0.0.1", epp_port), access_log=access_log)
    # a test of the gateway's subset hint: in production some filter of the operator's sets it
    filters = connection_manager(config)["http_filters"]
    at = next(i for i, f in enumerate(filters) if f["name"] == EXT_PROC)
    filters.insert(at, _subset_from_header())
    return config


def _subset_from_header() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [
                {
                    "header": SUBSET_HEADER,
                    "on_header_present": {
                        "metadata_namespace": SUBSET_NS,
                        "key": SUBSET_KEY,
                        "type": "STRING",
                    },
                    "remove": True,
                }
            ],
        },
    }
