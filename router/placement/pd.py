"""The one joint decision of a placement (docs/architecture.md §10): which decode worker, and
whether its prompt is prefilled there (*local*) or on a prefill worker (*remote*).
:func:`pick` turns a scored :class:`router.placement.placer.Decision` into a :class:`Pick`, the
typed answer every front door executes; a fleet with no ``prefill`` worker gets an *aggregated*
pick, exactly the best-ranked worker as before.

Decode worker first: the best-ranked worker that may decode (``decode`` or ``both``), ranked by
the one cost formula (its load, its KV capacity, its own cached prefix on every tier). Then local
against remote, in prompt tokens, never in tier-weighted scores (a block on DISK is one block
held, whatever it costs to load):

- ``threshold`` (Dynamo's and llm-d's kind): remote when the decode worker lacks at least
  ``min_remote_tokens`` tokens and at least ``min_remote_ratio`` of the prompt;
- ``cost``: local = (D's queued prefill + the tokens D lacks + loading what D holds off-GPU)
  × (1 + ``decode_interference`` × the stall weights of the requests on D: a prefill stalls each
  of their steps, so the more D carries, the dearer a prefill there). A request's weight
  (:func:`stall_weight`) is ``stall_reference_tokens`` / (its ``max_tokens`` − 1), at most
  ``MAX_STALL_WEIGHT``, 1 without ``max_tokens``: a stall of t adds t / (L − 1) to the time per
  output token of an answer of L tokens, so a short answer suffers it most (in the replay the
  answers of under 40 tokens stalled by a long prefill were the whole TPOT tail);
  remote = P's queued prefill + the tokens P lacks + P's loads + ``transfer_cost`` × the tokens
  D lacks + ``hop_cost_tokens``; the cheaper wins;
- ``always`` / ``never``.

The prefill worker is the eligible one (``prefill`` or ``both``, not D) with the least prefill
work for this request: queued prefill blocks not shared with it plus the blocks it lacks. No I/O,
no clock: the doors and the replay call it as it is.
"""

from __future__ import annotations

from collections.abc import Callable

from router.errors import NoHealthyWorker
from router.placement.agreement import reusable_tokens
from router.placement.decision import Decision
from router.placement.ports import WorkerView
from router.placement.scoring import Candidate, ScoreWeights
from router.settings.pd import PdSettings

__all__ = [
    "AGGREGATED",
    "LOCAL",
    "MAX_STALL_WEIGHT",
    "REMOTE",
    "Choice",
    "Pick",
    "cached_tokens",
    "pick",
    "stall_weight",
]

AGGREGATED, LOCAL, REMOTE = "aggregated", "local", "remote"
#: the most one request weighs: the price of stalling it stays bounded, whatever its max_tokens
#: (at the reference 200, answers of up to 51 tokens weigh this)
MAX_STALL_WEIGHT = 4.0


class Choice:
    """One candidate rank of a decision: its index there, its worker, its scores."""

    __slots__ = ("cand", "index", "worker")

    def __init__(self, index: int, worker: WorkerView, cand: Candidate) -> None:
        self.index = index
        self.worker = worker
        self.cand = cand


class Pick:
    """A placement's answer: the decode worker (the one serving the client), the prefill worker
    when the prompt is prefilled elsewhere, and why. ``decodes``: the decode worker then the
    others eligible, best first (retries); ``prefills``: the prefill workers, best first."""

    __slots__ = (
        "decision",
        "decodes",
        "fallback",
        "local_cost",
        "mode",
        "prefills",
        "reason",
        "remote_cost",
        "uncached_decode",
        "uncached_prefill",
    )

    def __init__(self, decision: Decision, decodes: list[Choice], mode: str, reason: str) -> None:
        self.decision = decision
        self.decodes = decodes
        self.prefills: list[Choice] = []
        self.mode = mode
        self.reason = reason
        self.uncached_decode = 0  # prompt tokens the decode worker lacks
        self.uncached_prefill = 0  # ... the chosen prefill worker lacks
        self.local_cost = 0.0  # cost mode's two sides, in prompt tokens
        self.remote_cost = 0.0
        #: what made a door prefill on the decode worker after all ("": nothing)
        self.fallback = ""

    @property
    def decode(self) -> Choice:
        return self.decodes[0]

    @property
    def prefill(self) -> Choice | None:
        """The prefill worker of a remote pick."""
        return self.prefills[0] if self.mode == REMOTE and self.prefills else None

    @property
    def disaggregated(self) -> bool:
        """The fleet has prefill workers: the doors say what was decided (headers, metrics)."""
        return self.mode != AGGREGATED

    def fall_back(self, cause: str) -> None:
        """A remote pick's prefill failed before the decode worker's first byte: the door
        prefills on the decode worker instead (``cause``: docs/metrics.md)."""
        self.mode, self.fallback = LOCAL, cause


def stall_weight(max_tokens: int | None, reference: int) -> float:
    """What a prefill on its worker costs one request, in requests of ``reference`` output
    tokens (the module docstring): 1 when its ``max_tokens`` is unknown; 0 for a single token
    (no stream to stall)."""
    if max_tokens is None:
        return 1.0
    if max_tokens < 2:
        return 0.0
    return min(MAX_STALL_WEIGHT, reference / (max_tokens - 1))


def cached_tokens(cand: Candidate, tokens: int, block_size: int) -> int:
    """Prompt tokens a rank can reuse: whole matched blocks, never the last prompt token (an
    engine always computes it)."""
    return reusable_tokens(cand.matched_blocks, tokens, block_size)


def pick(
    d: Decision,
    *,
    pd: PdSettings,
    weights: ScoreWeights,
    allow_remote: bool = True,
    eligible: Callable[[WorkerView], bool] | None = None,
) -> Pick:
    """The pick of a scored decision; raises :class:`NoHealthyWorker` when no eligible worker
    may decode."""
    states, candidates = d.states, d.candidates
    tokens, block_size, n = d.tokens, d.block_size, d.n
    usable = [i for i in d.order if eligible is None or eligible(states[i])]
    pd_fleet = any(st.config.role == "prefill" for st in states)
    decodes = [Choice(i, states[i], candidates[i]) for i in usable]
    if pd_fleet:
        decodes = [c for c in decodes if c.worker.config.role != "prefill"]
    if not decodes:
        where = " in the allowed subset" if len(usable) < len(d.order) else ""
        raise NoHealthyWorker(f"no healthy worker{where} for this request")
    if not pd_fleet:
        return Pick(d, decodes, AGGREGATED, "")
    p = Pick(d, decodes, LOCAL, "")
    dc = decodes[0].cand
    p.uncached_decode = tokens - cached_tokens(dc, tokens, block_size)
    did = decodes[0].worker.id
    prefills = [
        Choice(i, states[i], candidates[i])
        for i in usable
        if states[i].config.role != "decode" and states[i].id != did
    ]
    prefills.sort(key=lambda c: _prefill_work(c.cand, n))
    p.prefills = prefills
    if not prefills:
        p.reason = "no_prefill_worker"
        return p
    pc = prefills[0].cand
    p.uncached_prefill = tokens - cached_tokens(pc, tokens, block_size)
    if not allow_remote:
        p.reason = "decode_only_request"
    elif pd.mode == "never":
        p.reason = "mode_never"
    elif pd.mode == "always":
        p.mode, p.reason = REMOTE, "mode_always"
    elif pd.mode == "threshold":
        u = p.uncached_decode
        if u >= pd.min_remote_tokens and u >= pd.min_remote_ratio * tokens:
            p.mode, p.reason = REMOTE, "over_threshold"
        else:
            p.reason = "under_threshold"
    else:
        u = p.uncached_decode
        local = (_queued(dc) * block_size + u + _loads(dc, weights, block_size)) * (
            1 + pd.decode_interference * dc.stall
        )
        remote = (
            _queued(pc) * block_size
            + p.uncached_prefill
            + _loads(pc, weights, block_size)
            + pd.transfer_cost * u
            + pd.hop_cost_tokens
        )
        p.local_cost, p.remote_cost = local, remote
        if remote < local:
            p.mode, p.reason = REMOTE, "cost_remote"
        else:
            p.reason = "cost_local"
    return p


def _queued(c: Candidate) -> float:
    """Prefill blocks queued on a rank that this request does not share."""
    return max(0.0, c.inflight_prefill - c.shared_prefill)


def _prefill_work(c: Candidate, n: int) -> float:
    return _queued(c) + max(0, n - c.matched_blocks)


def _loads(c: Candidate, weights: ScoreWeights, block_size: int) -> float:
    """Loading what a rank holds off-GPU, in prompt tokens: a block on a tier of weight w costs
    1 − w of computing it (the tier weights' own meaning)."""
    total = 0.0
    for tier, blocks in c.by_tier.items():
        if tier != "GPU" and blocks:
            total += (1 - weights.tier_weight(tier)) * blocks * block_size
    return total
