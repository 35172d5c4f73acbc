"""The index's global cap when ``max_index_entries`` is not set: ``index.memory_fraction`` of the
memory this process may use (the machine's, or its container's cgroup limit when lower) over
the bytes an entry costs (docs/architecture.md §3).

``BYTES_PER_ENTRY``, measured: ``benchmarks/bench_ingest.py --only memory`` finds 147 bytes of
Python heap per (engine block, worker) entry when no two workers share a block (63 with shared
prefixes); ``benchmarks/bench_flood.py --capacity 0`` finds a real router's RSS 763 MiB up once
a flooding worker fills a cap of 4 M entries: 200 bytes an entry (dicts grown by
evictions and stores, allocator slack). The larger is the one that bounds the process.
"""

from __future__ import annotations

import os

__all__ = ["BYTES_PER_ENTRY", "default_index_cap", "memory_limit_bytes"]

BYTES_PER_ENTRY = 200

_CGROUP_LIMITS = (
    "/sys/fs/cgroup/memory.max",  # cgroup v2
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
)


def memory_limit_bytes() -> int | None:
    """Physical memory, or the cgroup's limit when lower; None when neither can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:  # "max": no limit (v2); v1 says a huge number
            limits.append(int(text))
    return min(limits) if limits else None


def default_index_cap(fraction: float) -> int:
    """Entries ``fraction`` of the memory limit holds (0, no cap, when it cannot be read)."""
    mem = memory_limit_bytes()
    return 0 if mem is None else max(1, int(mem * fraction / BYTES_PER_ENTRY))
