"""Replay workloads: Mooncake traces and generated shared-prefix workloads, one request shape.

A :class:`TraceRequest` is what both replay modes need: an arrival time, the prompt as a list of
*trace block ids* (each standing for ``trace_block`` tokens; ids are chained — an equal id means
the same block and the same prefix before it), the prompt length and the answer length.

How a block id becomes tokens is one place per mode:

* virtual time: :func:`block_tokens`, ``trace_block`` token ids seeded by the id (the id is
  spelled in the first tokens, so different ids never give equal blocks);
* live: :func:`block_text`, ``trace_block`` ASCII characters, which the bundled engine's byte
  tokenizer turns into as many tokens.

:func:`ideal_hit` is the infinite-cache bound a report compares every policy with.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from array import array
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SharedPrefixSpec",
    "TraceError",
    "TraceRequest",
    "block_text",
    "block_tokens",
    "ideal_hit",
    "leading_run",
    "load_mooncake",
    "pooled_lru_hit",
    "prompt_text",
    "prompt_tokens",
    "scale_rate",
    "shared_prefix",
    "spread_ties",
]

_ALPHABET = (string.ascii_letters + string.digits).encode()


class TraceError(ValueError):
    """A trace file or workload spec that cannot be replayed; the message says where."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # from the workload's start
    hash_ids: tuple[int, ...]  # one per trace block of the prompt (the last may be partial)
    input_length: int  # prompt tokens
    output_length: int  # tokens to generate


def load_mooncake(path: str | Path, start: int = 0, count: int | None = None) -> list[TraceRequest]:
    """Records ``[start, start + count)`` of a Mooncake JSONL file, arrivals from the first."""
    out: list[TraceRequest] = []
    t0: float | None = None
    end = None if count is None else start + count
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start or not line.strip():
                continue
            if end is not None and i >= end:
                break
            try:
                r = json.loads(line)
                ts = float(r["timestamp"]) / 1000
                ids = tuple(int(b) for b in r["hash_ids"])
                n, m = int(r["input_length"]), int(r["output_length"])
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{i + 1}: not a Mooncake record ({e})") from e
            if n <= 0 or m <= 0 or not ids:
                raise TraceError(f"{path}:{i + 1}: empty prompt, answer or hash_ids")
            t0 = ts if t0 is None else t0
            out.append(TraceRequest(ts - t0, ids, n, m))
    if not out:
        raise TraceError(f"{path}: no records in [{start}, {end if end is not None else 'end'})")
    return out


def spread_ties(requests: Sequence[TraceRequest], window_s: float) -> list[TraceRequest]:
    """The requests of each same-timestamp group spread evenly over ``[t, t + window_s)``: the
    k-th of m at ``t + k·window_s/m``, order kept. For a trace whose timestamps are coarser than
    its arrivals (conversation: 3 s steps, 89 % of gaps exactly 0), so that simultaneous bursts
    are a choice of the replay, not an artefact of the trace's resolution."""
    if window_s <= 0:
        return list(requests)
    groups: dict[float, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.arrival_s, []).append(i)
    out = list(requests)
    for t, idx in groups.items():
        m = len(idx)
        for k, i in enumerate(idx):
            r = requests[i]
            out[i] = TraceRequest(t + k * window_s / m, r.hash_ids, r.input_length, r.output_length)
    out.sort(key=lambda r: r.arrival_s)  # stable: equal arrivals keep the trace's order
    return out


def scale_rate(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """The requests arriving ``factor`` times as fast (each arrival / ``factor``), prompts and
    answers unchanged: the same traffic as a heavier load on the same engines (unlike live's
    ``--speedup``, which also speeds the engines up and so keeps the load)."""
    if factor <= 0:
        raise TraceError(f"--rate-scale must be positive, got {factor}")
    if factor == 1:
        return list(requests)
    return [
        TraceRequest(r.arrival_s / factor, r.hash_ids, r.input_length, r.output_length)
        for r in requests
    ]


@dataclass(frozen=True)
class SharedPrefixSpec:
    """``groups`` system prompts, each shared by ``prompts`` users asking questions; with
    ``turns > 1`` each user comes back with the whole conversation so far plus a new question."""

    groups: int = 8
    prompts: int = 16
    system_len: int = 4096
    question_len: int = 256
    output_len: int = 128
    turns: int = 1
    rate: float = 4.0  # requests per second (Poisson arrivals)
    think_s: float = 5.0  # mean pause before a user's next turn
    seed: int = 0


def shared_prefix(spec: SharedPrefixSpec, trace_block: int) -> list[TraceRequest]:
    """The generated workload, in arrival order. Deterministic for ``spec.seed``."""
    if min(spec.groups, spec.prompts, spec.turns, spec.system_len, spec.question_len) <= 0:
        raise TraceError("groups, prompts, turns, system and question lengths must be positive")
    if spec.rate <= 0 or spec.output_len <= 0 or spec.think_s < 0:
        raise TraceError("rate and output length must be positive, think time >= 0")
    rng = random.Random(spec.seed)
    ids = iter(range(1 << 62))

    def blocks(n: int) -> list[int]:
        return [next(ids) for _ in range(-(-n // trace_block))]

    # system prompts end on a block boundary (padded) so every question starts a fresh block
    systems = [blocks(spec.system_len) for _ in range(spec.groups)]
    sys_len = len(systems[0]) * trace_block
    users = [(g, u) for g in range(spec.groups) for u in range(spec.prompts)]
    rng.shuffle(users)
    t = 0.0
    out: list[TraceRequest] = []
    for g, _ in users:
        t += rng.expovariate(spec.rate)
        history = list(systems[g])
        length = sys_len
        at = t
        for _ in range(spec.turns):
            # each turn: the conversation so far, then a new question (own blocks)
            q = blocks(spec.question_len)
            history += q
            length += len(q) * trace_block
            out.append(TraceRequest(at, tuple(history), length, spec.output_len))
            answer = blocks(spec.output_len)
            history += answer
            length += len(answer) * trace_block
            at += rng.expovariate(1 / spec.think_s) if spec.think_s else 0.0
    out.sort(key=lambda r: r.arrival_s)
    return out


def block_tokens(block_id: int, size: int) -> list[int]:
    """``size`` token ids in ``[0, 65536)`` for one trace block: the id spelled in the first
    four (unique below 2^64), then a stream seeded by it."""
    head = [(block_id >> s) & 0xFFFF for s in (0, 16, 32, 48)]
    body = array("H", hashlib.shake_128(b"kvrouter-block:%d" % block_id).digest(2 * size))
    return (head + body.tolist())[:size]


def prompt_tokens(
    r: TraceRequest, size: int, cache: dict[int, list[int]] | None = None
) -> list[int]:
    """The prompt's token ids (``r.input_length`` of them); ``cache`` keeps blocks seen."""
    out: list[int] = []
    for b in r.hash_ids:
        if cache is None:
            out += block_tokens(b, size)
        else:
            toks = cache.get(b)
            if toks is None:
                toks = cache[b] = block_tokens(b, size)
            out += toks
    return out[: r.input_length]


def block_text(block_id: int, size: int) -> str:
    """``size`` deterministic ASCII characters for one trace block (live mode's prompts)."""
    digest = hashlib.shake_128(b"kvrouter-block:%d" % block_id).digest(size)
    return bytes(_ALPHABET[b % len(_ALPHABET)] for b in digest).decode()


def prompt_text(r: TraceRequest, size: int) -> str:
    return "".join(block_text(b, size) for b in r.hash_ids)[: r.input_length]


def leading_run(ids: Iterable[int], held: Container[int]) -> int:
    """How many of ``ids``, from the first, ``held`` contains (chained ids: a cached prefix)."""
    run = 0
    for b in ids:
        if b not in held:
            break
        run += 1
    return run


def ideal_hit(requests: Iterable[TraceRequest], trace_block: int) -> float:
    """Σ reusable / Σ prompt tokens with an infinite cache and one worker: each request's leading
    run of blocks some earlier request held (ids are chained: equal id, equal prefix)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        hit += min(leading_run(r.hash_ids, seen) * trace_block, r.input_length)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def pooled_lru_hit(requests: Iterable[TraceRequest], trace_block: int, capacity: int) -> float:
    """The hit rate of one LRU cache of ``capacity`` tokens — the whole fleet's, shared with no
    copy twice — in trace blocks, answers taking room as the engines cache them too. A reference,
    not a bound: engines evict LRU, which is what keeps every policy well under the ideal, but a
    placement that partitions the content can beat one shared LRU by a little."""
    lru: OrderedDict[int, None] = OrderedDict()
    slots = max(1, capacity // trace_block)
    fresh = -1  # answer blocks: ids no prompt uses
    hit = total = 0
    for r in requests:
        hit += min(leading_run(r.hash_ids, lru) * trace_block, r.input_length)
        total += r.input_length
        for b in r.hash_ids:
            lru[b] = None
            lru.move_to_end(b)
        for _ in range(-(-r.output_length // trace_block)):
            lru[fresh] = None
            fresh -= 1
        while len(lru) > slots:
            lru.popitem(last=False)
    return hit / total if total else 0.0


def check_block_sizes(trace_block: int, block_size: int, requests: Sequence[TraceRequest]) -> None:
    if trace_block <= 0 or trace_block % block_size:
        raise TraceError(
            f"the trace block ({trace_block} tokens) must be a multiple of the engine block "
            f"size ({block_size}): otherwise equal trace blocks make unequal engine blocks"
        )
    if not requests:
        raise TraceError("the workload is empty")
