"""Worker scoring (docs/architecture.md §5): pure functions, no I/O, no clocks, no global state.

For a request of ``n`` full blocks and each candidate worker rank ``w``::

    c(w)    = Σ_t weight_t · m_t(w)  +  predicted(w)            (predicted blocks count like GPU)
    cost(w) = overlap_weight · (inflight_prefill(w) + n − c(w) + (cache_credit − 1) · (c* − c(w))
                                + overflow_weight · max(0, active_blocks(w) + n − capacity(w)))
              + active_blocks(w) [+ scraped(w)]

with ``c*`` the largest credit of any healthy candidate. The last prefill term charges turning
away from a cache: recomputing blocks another worker holds makes this request wait for them
(``n − c`` counts that), and it also adds that prefill to the fleet — every request queued behind
it waits too — and copies the prefix into a second cache, evicting someone else's. With
``cache_credit = 1`` the cost is the least time to first token for *this* request alone; in
``kvrouter replay`` that gave up 2-2.5 points of hit rate (docs/replay.md). ``c*`` is the same for
every candidate, so it changes no order; it keeps costs non-negative and readable: the worker
holding the most pays nothing for reuse, another pays ``cache_credit`` prefill blocks per block
it lacks.

The overflow term is what a placement costs a cache near capacity: while it runs the request
holds all its ``n`` blocks (the cached ones too), beside the blocks the requests running on ``w``
hold; what does not fit in ``capacity(w)`` (GPU blocks, from the index: the worker's reported
KV size) waits for a decode to end or preempts one, and every block it takes evicts what the
cache kept for later. Each such block costs ``overflow_weight`` blocks of prefill. A worker of
unknown capacity, or with room, pays nothing: on caches that are not full it changes no order.

Load is what *this* request competes with. Blocks of the request that requests already in flight
on ``w`` hold (a shared prefix: chained hashes make it a leading run) are neither queued work nor
new memory for it: they are taken off ``inflight_prefill`` (up to what is in flight) and off
``active_blocks``. Without that, a prefix being prefilled on ``w`` would be charged twice — as
queued work and as missing credit — and concurrent requests sharing a new prefix would scatter
over every idle worker, each recomputing it (herding, docs/architecture.md §5).

``scraped(w)`` blends the worker's own ``/metrics`` (requests running / waiting, KV usage) when
weights for them are configured. The minimum cost wins; ties break on less load, then a stable hash
of the request and worker, so equal requests place the same way in every router replica. With a
temperature ``T > 0`` the first choice is sampled from ``softmax(−cost'/T)`` over costs normalized
to [0, 1]; the others follow in cost order (they are the retry order).

Router replicas that sync (docs/architecture.md §9) hold the same view once a sync has landed,
so inside one sync delay — a burst of arrivals — every replica would take the same worker. Each
has a *lane* (its place among the replicas it hears; 0 alone): lane ``k > 0`` takes first the
``k``-th (mod their count) of the workers whose cost is within ``replica_spread · overlap_weight
· (n − c(best))`` of the best, the request's own prefill at the best worker scaled — a worker the
one router would have taken had a same-instant request taken the best. Lane 0 is unchanged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import msgspec

from indexer.events import CANONICAL_TIERS, DEFAULT_TIER_WEIGHTS
from router.settings.scoring import (
    DEFAULT_CACHE_CREDIT,
    DEFAULT_OVERFLOW_WEIGHT,
    DEFAULT_OVERLAP_WEIGHT,
    DEFAULT_REPLICA_SPREAD,
)
from router.types import ScrapedLoad, WorkerKey, worker_hash

__all__ = [
    "Candidate",
    "ScoreWeights",
    "credited_blocks",
    "rank",
    "score",
    "tie_hash",
    "tier_breakdown",
]

_M64 = (1 << 64) - 1


class ScoreWeights(msgspec.Struct, frozen=True):
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    tier_weights: Mapping[str, float] = msgspec.field(
        default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS)
    )
    running_weight: float = 0.0
    waiting_weight: float = 0.0
    kv_usage_weight: float = 0.0
    cache_credit: float = DEFAULT_CACHE_CREDIT
    overflow_weight: float = DEFAULT_OVERFLOW_WEIGHT
    replica_spread: float = DEFAULT_REPLICA_SPREAD

    def tier_weight(self, tier: str) -> float:
        """Unknown tiers are scored like EXTERNAL (docs/architecture.md §2), never like GPU."""
        w = self.tier_weights.get(tier)
        if w is None:
            w = self.tier_weights.get("EXTERNAL", 0.3)
        return w


class Candidate(msgspec.Struct, gc=False):
    """One worker rank as the scorer sees it. Filled by the router, scored here."""

    key: WorkerKey
    healthy: bool = True
    matched_blocks: int = 0
    by_tier: Mapping[str, int] = msgspec.field(default_factory=dict)
    predicted_blocks: int = 0
    inflight_prefill: float = 0.0
    active_blocks: int = 0
    shared_active: int = 0
    shared_prefill: int = 0
    scraped: ScrapedLoad | None = None
    whash: int = -1  # worker_hash(key), precomputed by the caller; -1: compute here
    capacity: int = 0  # router blocks the rank's GPU KV holds; 0: not known
    stall: float = 0.0  # the stall weights of the requests placed there (the load ledger's)
    # outputs, set by score()
    credited: float = 0.0
    cost: float = math.inf


def credited_blocks(by_tier: Mapping[str, int], predicted: int, weights: ScoreWeights) -> float:
    c = float(predicted)
    tw = weights.tier_weights  # (tier_weight, inlined: this runs per candidate per request)
    for tier, m in by_tier.items():
        if m:
            w = tw.get(tier)
            if w is None:
                w = tw.get("EXTERNAL", 0.3)
            c += w * m
    return c


def score(c: Candidate, n: int, weights: ScoreWeights, best_credit: float = 0.0) -> float:
    """Set and return ``c.cost`` (and ``c.credited``) for a request of ``n`` full blocks;
    ``best_credit`` is ``c*``, the largest credit among the healthy candidates."""
    return _cost(
        c, n, weights, credited_blocks(c.by_tier, c.predicted_blocks, weights), best_credit
    )


def _cost(c: Candidate, n: int, weights: ScoreWeights, credit: float, best: float) -> float:
    prefill = c.inflight_prefill - c.shared_prefill
    if prefill < 0.0:
        prefill = 0.0
    active = c.active_blocks - c.shared_active
    if active < 0:
        active = 0
    lacked = best - credit if best > credit else 0.0
    work = prefill + n - credit + (weights.cache_credit - 1.0) * lacked
    if c.capacity > 0:
        over = active + n - c.capacity
        if over > 0:
            work += weights.overflow_weight * over
    cost = weights.overlap_weight * work + active
    s = c.scraped
    if s is not None:
        cost += (
            weights.running_weight * s.running
            + weights.waiting_weight * s.waiting
            + weights.kv_usage_weight * s.kv_usage
        )
    c.credited = credit
    c.cost = cost
    return cost


def tie_hash(request_key: int, whash: int) -> int:
    """Stable per (request, worker): equal-cost requests spread, each always the same way."""
    x = (request_key ^ (whash * 0x9E3779B97F4A7C15)) & _M64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    return x


def rank(
    candidates: Sequence[Candidate],
    n: int,
    weights: ScoreWeights,
    *,
    request_key: int = 0,
    temperature: float = 0.0,
    rng: random.Random | None = None,
    lane: tuple[int, int] = (0, 1),
) -> list[int]:
    """Score every candidate; return the indices of the healthy ones, best first.

    The order is the retry order of the proxy: the first is the choice.
    """
    credits = []
    best = 0.0
    for c in candidates:
        x = credited_blocks(c.by_tier, c.predicted_blocks, weights)
        credits.append(x)
        if x > best and c.healthy:
            best = x
    healthy: list[tuple[float, float, int]] = []
    append = healthy.append
    for i, c in enumerate(candidates):
        cost = _cost(c, n, weights, credits[i], best)
        if c.healthy:
            append((cost, c.inflight_prefill + c.active_blocks, i))
    healthy.sort()
    order = [t[2] for t in healthy]
    # equal (cost, load): the stable per-(request, worker) hash decides, then the index; hashed
    # only where there is such a tie (the hash is bigint arithmetic, a µs a candidate)
    k, m = 0, len(healthy)
    while k < m - 1:
        j = k + 1
        while j < m and healthy[j][0] == healthy[k][0] and healthy[j][1] == healthy[k][1]:
            j += 1
        if j - k > 1:
            order[k:j] = sorted(order[k:j], key=lambda i: (_tie(candidates[i], request_key), i))
        k = j
    if lane[0] and lane[1] > 1 and m > 1 and weights.replica_spread > 0:
        order = _in_lane(order, healthy, candidates[order[0]], n, weights, lane[0])
    return _tempered(order, candidates, temperature, rng)


def _in_lane(
    order: list[int],
    healthy: Sequence[tuple[float, float, int]],
    best: Candidate,
    n: int,
    weights: ScoreWeights,
    lane: int,
) -> list[int]:
    """Replica ``lane``'s first choice: the ``lane``-th (mod their count) of the workers whose
    cost is within ``replica_spread`` of this request's own prefill of the best (healthy is
    sorted by cost, as ``order``)."""
    own = n - best.credited
    limit = healthy[0][0] + weights.replica_spread * weights.overlap_weight * max(1.0, own)
    near = 1
    while near < len(healthy) and healthy[near][0] <= limit:
        near += 1
    pick = lane % near
    if pick:
        order.insert(0, order.pop(pick))
    return order


def _tempered(
    order: list[int],
    candidates: Sequence[Candidate],
    temperature: float,
    rng: random.Random | None,
) -> list[int]:
    if temperature > 0.0 and len(order) > 1:
        costs = [candidates[i].cost for i in order]
        first = _sample(costs, temperature, rng if rng is not None else random.Random())
        if first:
            order.insert(0, order.pop(first))
    return order


def _tie(c: Candidate, request_key: int) -> int:
    return tie_hash(request_key, c.whash if c.whash >= 0 else worker_hash(c.key))


def _sample(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    lo, hi = min(costs), max(costs)
    span = hi - lo
    if span <= 0.0:
        return rng.randrange(len(costs))
    logits = [-((c - lo) / span) / temperature for c in costs]
    top = max(logits)
    ws = [math.exp(x - top) for x in logits]
    r = rng.random() * sum(ws)
    acc = 0.0
    for i, w in enumerate(ws):
        acc += w
        if r < acc:
            return i
    return len(ws) - 1


def tier_breakdown(by_tier: Mapping[str, int]) -> dict[str, int]:
    """The four canonical tiers always present (0 when absent), then any unknown tier names."""
    get = by_tier.get
    out = {t: get(t, 0) for t in CANONICAL_TIERS}
    for t, m in by_tier.items():
        if t not in out:
            out[t] = m
    return out
