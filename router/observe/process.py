"""The router's process metrics and build info (``process_*``, ``kvrouter_build_info``), and its
installed version; re-exported by :mod:`router.observe.metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

__all__ = ["installed_version", "register_process_metrics"]


def installed_version() -> str:
    """kvrouter's installed version (build info, the OpenAPI document)."""
    from importlib import metadata

    try:
        return metadata.version("kvrouter")
    except metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def register_process_metrics(registry: CollectorRegistry) -> None:
    """``process_*`` (CPU, memory, fds: prometheus_client's collector) and
    ``kvrouter_build_info`` (version and Python, value 1) on the router's registry."""
    import platform

    from prometheus_client import Gauge, ProcessCollector

    version = installed_version()
    ProcessCollector(registry=registry)
    info = Gauge(
        "kvrouter_build_info",
        "1, labelled with the running kvrouter version and Python version",
        ["version", "python"],
        registry=registry,
    )
    info.labels(version, platform.python_version()).set(1)
