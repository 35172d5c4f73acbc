"""Scoring settings (``scoring:``): the cost formula's weights and their defaults, with what
``kvrouter replay`` measured for each. The formula itself is :mod:`router.placement.scoring`;
this is the one home of its defaults, which the settings and the scorer both read."""

from __future__ import annotations

import msgspec

from indexer.events import DEFAULT_TIER_WEIGHTS
from router.errors import config_check as _check

__all__ = [
    "DEFAULT_CACHE_CREDIT",
    "DEFAULT_OVERFLOW_WEIGHT",
    "DEFAULT_OVERLAP_WEIGHT",
    "DEFAULT_REPLICA_SPREAD",
    "ScoringSettings",
]

#: A block of prefill work (queued or the request's own) costs this many blocks held by running
#: requests. Prefill is what a new request waits for; held blocks cost it only a per-step decode
#: share. At 1.0 the router gave up 4-5k cached tokens to avoid a worker decoding 30k more; in
#: ``kvrouter replay`` (virtual time, 8 × 1M-token workers) hit rate and TTFT mean improve up to
#: 16 and flatten past it on conversation and synthetic traces, held-out slices included
#: (docs/replay.md).
DEFAULT_OVERLAP_WEIGHT = 16.0

#: A block of the request that another worker holds and this one lacks costs this many blocks of
#: prefill (see the module docstring). ``kvrouter replay``, virtual time, 8 × 1M-token workers, hit rate at 1 / 3 / 8 / 12:
#: conversation [0,2000) 23.2 / 24.9 / 25.2 / 25.4 %, synthetic [0,3000) 36.0 / 37.7 / 37.7 / 37.7 %
#: with TTFT p99 rising past 8 (2,041 / 2,065 / 2,140 / 2,170 ms). Held out at 8: conversation
#: [4000,6000) 21.0 -> 23.7 %, synthetic [3000,3993) 66.9 -> 68.8 %, TTFT mean within 1 %.
DEFAULT_CACHE_CREDIT = 8.0

#: A block of the request that would not fit in the worker's KV cache beside the blocks its
#: running requests hold costs this many blocks of prefill: it waits for a decode to end (or
#: preempts one) and evicts what the cache kept. Off for a worker of unknown capacity (the
#: index learns it from the worker's ``/metrics``). ``kvrouter replay``, virtual time, 8 workers
#: of 128k tokens, conversation [0,2000): hit 5.0 -> 5.3 %, TTFT mean / p99 572 / 4,132 -> 562 /
#: 4,043 ms, preemptions 14 -> 4; held out, [2000,4000): hit 5.1 -> 4.9 %, TTFT 534 / 3,517 ->
#: 529 / 3,408 ms, preemptions 11 -> 1. At 256k and 1M it never binds (docs/replay.md, "Under
#: cache pressure").
DEFAULT_OVERFLOW_WEIGHT = 1.0

#: With synced router replicas (``replicas:``), a replica in lane k > 0 first takes the k-th (mod
#: their count) of the workers whose cost is within this many of the request's own prefill blocks
#: (× overlap_weight) of the best, instead of the best: replicas that hear each other hold the
#: same view, so within one sync delay they would all take the same worker, and in different
#: lanes they take different near-best ones. One router (lane 0) is unchanged. ``kvrouter
#: replay``, virtual time, 4 synced replicas, TTFT mean / p99 ms at 0 / 0.25 / 0.5 / 1:
#: conversation [0,2000) 739 / 4,482 -> 612 / 4,399 -> 619 / 4,152 -> 624 / 4,227 (one router:
#: 460 / 3,292); synthetic [0,3000) 337 / 2,056 -> 341 / 2,184 -> 344 / 2,169 (one router 336 /
#: 2,140), hit rate equal within 0.3 point (docs/replay.md, "Router replicas").
DEFAULT_REPLICA_SPREAD = 0.25


class ScoringSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    cache_credit: float = DEFAULT_CACHE_CREDIT
    overflow_weight: float = DEFAULT_OVERFLOW_WEIGHT
    replica_spread: float = DEFAULT_REPLICA_SPREAD
    tier_weights: dict[str, float] = msgspec.field(
        default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS)
    )
    recompute_s_per_block: float | None = None
    tier_load_s_per_block: dict[str, float] = msgspec.field(default_factory=dict)
    temperature: float = 0.0
    seed: int | None = None
    predicted_ttl_s: float = 2.0
    predicted_max_blocks: int = 1_000_000
    running_weight: float = 0.0
    waiting_weight: float = 0.0
    kv_usage_weight: float = 0.0
    #: say why each pick went where it did (x-kvrouter-why on the answers, ``why`` on the
    #: access lines): off by default, as it tells clients the fleet's worker ids and costs
    explain: bool = False

    def __post_init__(self) -> None:
        _check(self.overlap_weight >= 0, "overlap_weight", "must be >= 0")
        _check(self.cache_credit >= 0, "cache_credit", "must be >= 0")
        _check(self.overflow_weight >= 0, "overflow_weight", "must be >= 0")
        _check(self.replica_spread >= 0, "replica_spread", "must be >= 0")
        for tier, w in self.tier_weights.items():
            _check(0 <= w <= 1, f"tier_weights.{tier}", "must be between 0 and 1")
        if self.recompute_s_per_block is not None:
            _check(self.recompute_s_per_block > 0, "recompute_s_per_block", "must be > 0")
        for tier, s in self.tier_load_s_per_block.items():
            _check(s >= 0, f"tier_load_s_per_block.{tier}", "must be >= 0")
        _check(self.temperature >= 0, "temperature", "must be >= 0")
        _check(self.predicted_ttl_s >= 0, "predicted_ttl_s", "must be >= 0")
        _check(self.predicted_max_blocks >= 0, "predicted_max_blocks", "must be >= 0")
        for k in ("running_weight", "waiting_weight", "kv_usage_weight"):
            _check(getattr(self, k) >= 0, k, "must be >= 0")

    def effective_tier_weights(self) -> dict[str, float]:
        """Configured weights, upper-cased; with ``recompute_s_per_block`` set, a tier listed in
        ``tier_load_s_per_block`` gets ``1 - load/recompute`` (clamped to [0, 1]) instead."""
        weights = {k.upper(): v for k, v in self.tier_weights.items()}
        if self.recompute_s_per_block is not None:
            for tier, load in self.tier_load_s_per_block.items():
                weights[tier.upper()] = min(1.0, max(0.0, 1.0 - load / self.recompute_s_per_block))
        return weights

    @property
    def scrapes_metrics(self) -> bool:
        return self.running_weight > 0 or self.waiting_weight > 0 or self.kv_usage_weight > 0
