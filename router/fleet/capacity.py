"""A worker's KV capacity, read from its ``/metrics``: the engine blocks each of its tiers holds,
per data-parallel rank. A worker cannot hold more blocks than that, so it caps the rank's entries
in the index (docs/architecture.md §3); the health checker reads it (:mod:`router.fleet.health`).

- vLLM: ``vllm:cache_config_info``, a gauge of value 1 whose labels carry the cache config:
  ``num_gpu_blocks`` (GPU), and ``num_cpu_blocks`` (CPU_PINNED) when it offloads to CPU ("None"
  otherwise); one line per engine, ``engine`` being its data-parallel rank. The bundled engine
  prints the same line, with ``num_disk_blocks`` and ``num_external_blocks`` for its DISK and
  EXTERNAL tiers when it has them.
- SGLang: ``sglang:max_total_num_tokens`` (its KV pool, in tokens) over ``sglang:page_size``
  (1, SGLang's default, when not exported), per ``dp_rank``; tensor- and pipeline-parallel ranks
  repeat the same pool, the largest is kept.

Tiers a worker does not report are not sized here: the index then keeps at least its default
cap for that rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

__all__ = ["Capacity", "parse_kv_capacity", "rank_capacities"]

#: Engine blocks per canonical tier.
Capacity = dict[str, int]

_VLLM = "vllm:cache_config_info"
_SGLANG_TOKENS = "sglang:max_total_num_tokens"
_SGLANG_PAGE = "sglang:page_size"
#: ``vllm:cache_config_info`` label -> tier
_VLLM_TIERS = {
    "num_gpu_blocks": "GPU",
    "num_cpu_blocks": "CPU_PINNED",
    "num_disk_blocks": "DISK",
    "num_external_blocks": "EXTERNAL",
}
_LABEL = re.compile(r'([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"')
#: A block count past this is not a KV cache (and would not fit a float exactly).
_MAX_BLOCKS = 1 << 48


def _sample(line: str) -> tuple[dict[str, str], float] | None:
    """Labels and value of one exposition line (None when it does not parse)."""
    brace = line.find("{")
    close = line.rfind("}")
    if brace < 0 or close < brace:
        labels: dict[str, str] = {}
        rest = line.split(None, 1)[1] if " " in line else ""
    else:
        labels = dict(_LABEL.findall(line, brace, close))
        rest = line[close + 1 :]
    try:
        value = float(rest.split()[0])
    except (IndexError, ValueError):
        return None
    return labels, value


def _count(text: str | float) -> int | None:
    """A non-negative whole number of blocks or tokens, else None ("None", NaN, garbage)."""
    try:
        v = float(text)
    except ValueError:
        return None
    if not math.isfinite(v) or v < 0 or v >= _MAX_BLOCKS:
        return None
    return int(v)


def _rank(labels: Mapping[str, str], name: str) -> int | None:
    r = labels.get(name, "")
    return int(r) if r.isdigit() else None


def parse_kv_capacity(text: str) -> dict[int | None, Capacity]:
    """Engine blocks per tier, per dp rank (None: a line that names no rank, so every rank),
    from Prometheus text; empty when the worker reports no capacity."""
    out: dict[int | None, Capacity] = {}
    tokens: dict[int | None, int] = {}
    pages: dict[int | None, int] = {}
    for line in text.splitlines():
        if not line.startswith((_VLLM, _SGLANG_TOKENS, _SGLANG_PAGE)):
            continue
        name = line[: len(line) - len(line.lstrip("abcdefghijklmnopqrstuvwxyz_:"))]
        sample = _sample(line)
        if sample is None:
            continue
        labels, value = sample
        if name == _VLLM:
            found = {
                tier: n
                for label, tier in _VLLM_TIERS.items()
                if (n := _count(labels.get(label, "None"))) is not None
            }
            if "GPU" in found:  # without it the line sizes nothing the index could rely on
                cap = out.setdefault(_rank(labels, "engine"), {})
                for tier, n in found.items():
                    cap[tier] = max(cap.get(tier, 0), n)
        elif name in (_SGLANG_TOKENS, _SGLANG_PAGE):
            n = _count(value)
            if n is None:
                continue
            into = tokens if name == _SGLANG_TOKENS else pages
            rank = _rank(labels, "dp_rank")
            into[rank] = max(into.get(rank, 0), n)
    for rank, n in tokens.items():
        page = pages.get(rank) or pages.get(None) or 1
        out.setdefault(rank, {})["GPU"] = n // page
    return out


def rank_capacities(found: Mapping[int | None, Capacity], dp_ranks: int) -> list[Capacity | None]:
    """The capacity of each of a worker's ``dp_ranks`` ranks (None where it is not known): the
    rank's own line, else a line naming no rank. A one-rank worker that reports exactly one rank
    takes it whatever its number (a data-parallel rank served on its own port labels it so)."""
    if dp_ranks == 1 and len(found) == 1:
        return [dict(next(iter(found.values())))]
    out: list[Capacity | None] = []
    for r in range(dp_ranks):
        cap = found.get(r, found.get(None))
        out.append(None if cap is None else dict(cap))
    return out
