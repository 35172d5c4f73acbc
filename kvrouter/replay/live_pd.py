"""A live prefill/decode fleet's rows (``kvrouter replay --mode live --pd P:D``): their names and
their own columns, from the engines' counters after the run (:mod:`kvrouter.replay.live` runs
them; the fleet is :class:`kvrouter.replay.fleet.FleetSpec` with ``pd``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrouter.replay.fleet import TPOT, EngineCounters

__all__ = ["engine_tpot_ms", "pd_columns", "pd_label"]


def pd_label(policy: str, pd: tuple[int, int], workers: int, targets: Any) -> str:
    """A live PD run's row, named as the virtual sweep names its rows (``kvrouter 4:4 always``,
    ``kvrouter 8 aggregated``); ``targets``: the run's :class:`kvrouter.replay.live.LiveTargets`."""
    ratio = "{}:{}".format(*pd)
    if policy == "kvrouter-aggregated":
        return f"kvrouter {workers} aggregated"
    if policy == "vllm-router":
        return f"vllm-router {ratio} {targets.vllm_router_policy}"
    if policy == "kvrouter":
        return f"kvrouter {ratio} {targets.pd_mode}" if targets.pd_mode else f"kvrouter {ratio}"
    return f"{policy} {ratio}"


def pd_columns(engines: Sequence[EngineCounters]) -> dict[str, Any]:
    """A PD fleet's columns: the share of requests whose prompt a prefill engine computed
    (``remote_%``: prefill legs over the decode side's requests), the prefill engines' own
    prefix hit rate (``P_hit_%``: cached over looked-up tokens, so a preempted prefill's second
    lookup counts in both; what the prefill pick found cached, the decode side's pulls aside),
    and the engines' PD counters: pulls done, pulls failed (the decode side's, with their
    reasons) and GB pulled (the runner's own bytes: the sim's are small self-checking payloads,
    not the modeled KV size)."""
    pre = [e for e in engines if e.role == "prefill"]
    dec = [e for e in engines if e.role != "prefill"]
    served = sum(e.requests for e in dec)
    prompt = sum(e.queried_tokens for e in pre)

    def total(name: str) -> float:
        return sum(e.pd.get(f"kvrouter_engine_pd_{name}_total", 0.0) for e in engines)

    return {
        "remote_%": round(100 * sum(e.requests for e in pre) / max(1, served), 1),
        "P_hit_%": round(100 * sum(e.cached_tokens for e in pre) / max(1, prompt), 1),
        "pulls": int(total("pulls_done")),
        "pull_fail": _failures(engines),
        "GB_pulled": round(total("pulled_bytes") / 1e9, 2),
    }


def engine_tpot_ms(engines: Sequence[EngineCounters]) -> float | None:
    """The decoding engines' own time per output token, mean over their requests (``eng_tpot_ms``,
    ``vllm:request_time_per_output_token_seconds``): the client's TPOT less the router's hop
    and the client's own delays, so a gap between the two is not the engines'. None: no engine
    reports it."""
    dec = [e for e in engines if e.role != "prefill"]
    n = sum(e.pd.get(f"{TPOT}_count", 0.0) for e in dec)
    return round(1000 * sum(e.pd.get(f"{TPOT}_sum", 0.0) for e in dec) / n, 1) if n else None


def _failures(engines: Sequence[EngineCounters]) -> str:
    """``0``, or ``N (reason n, ...)``: the decode side's failed pulls."""
    name = "kvrouter_engine_pd_pulls_failed_total:"
    by: dict[str, float] = {}
    for e in engines:
        for key, v in e.pd.items():
            if key.startswith(name) and v:
                by[key[len(name) :]] = by.get(key[len(name) :], 0.0) + v
    if not by:
        return "0"
    return (
        f"{int(sum(by.values()))} ("
        + ", ".join(f"{k} {int(v)}" for k, v in sorted(by.items()))
        + ")"
    )
