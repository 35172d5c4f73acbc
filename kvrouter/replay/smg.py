"""smg 1.13.0's ``--policy cache_aware`` (SGLang's gateway, Rust), emulated for virtual time.

Read from the sdist ``smg-1.13.0.tar.gz`` (PyPI), with every default the ``smg launch`` CLI gives
(``model_gateway/src/main.rs`` l. 371-406: ``--cache-threshold`` 0.3, ``--balance-abs-threshold``
64, ``--balance-rel-threshold`` 1.5; l. 753-755: ``--load-monitor-interval`` 10 s):

* ``model_gateway/src/policies/cache_aware.rs``: ``select_worker_scanned`` (l. 1479-1566) — the
  eligible workers (health and the overload veto), their mean in-flight count ``avg``; over HTTP
  the approximate *string* tree (``select_worker_with_text``, l. 3215-3290): a match covering more
  than ``cache_threshold`` (0.3) of the prompt makes the holders of the deepest matched node the
  affinity group (``select_matched_candidate``, l. 2283-2344, ``overlap_decay`` 0: no decay),
  else the miss path; the chosen worker's prompt is inserted in the tree either way.
  ``select_final_from_affinity`` (l. 2068-2103): the group's workers under the count-pressure
  gate, else every eligible worker under it (a spill), else every eligible worker; the final pick
  is LeastLoad's expected wait over that set (``select_expected_wait``, l. 1773-1796). The gate
  (``over_count_pressure_gate`` / ``absolute_margin``, l. 1805-1831): in-flight ``> 1.5 · avg``
  and ``> avg + min(64, max(⌈2·√avg⌉, 4))``. The KV-imbalance gate (``is_kv_imbalanced``,
  l. 638-660) is off at its default thresholds (1.0), as are the hash index and the mesh.
* ``model_gateway/src/policies/least_load.rs`` (``score``, l. 291-331; ``queued_tokens``,
  ``running_estimated_tokens``, ``unaccounted_requests``, ``select_min_expected_wait_with_
  freshness``, l. 425-624) and ``worker/expected_wait.rs``: with a load report,
  ``(waiting·p̄ + running·p̄ + unaccounted·p̄ + since-poll tokens) / throughput +
  0.15 · k / (1 − k)`` seconds, ``p̄`` = 1024 tokens (an HTTP request's size is not known, so each
  dispatch since the last poll also counts ``p̄``), ``k`` the reported KV usage, throughput the
  reported ``gen_throughput`` else 2,000 tok/s; ties within 1 µs drawn uniformly; unaccounted =
  in-flight − (reported running + waiting + dispatches since the poll), at least 0. Without any
  report (a "dark" fleet) the score is the in-flight count (join the shortest queue).
* ``worker/monitor.rs`` (``fetch_http_load``, l. 971-1013; ``fetch_http_load_sglang``,
  l. 1081-1102): loads are polled every ``load_monitor_interval`` (10 s); an SGLang worker's come
  from its ``/metrics`` gauges (``num_running_reqs``, ``num_queue_reqs``, ``token_usage``,
  ``gen_throughput``), with no sample time, so a report resets the since-poll credit.
  ``worker/overload.rs`` (``is_overloaded``, l. 114-124; defaults from ``src/smg/
  router_args.py`` l. 269-275): a report with ``waiting ≥ 8`` or KV usage ``≥ 0.8`` takes the
  worker out of selection until the next; when every worker is out, the request goes to the least
  loaded of them without the policy (``routers/common/overload.rs``, l. 115-161).

Here the engines report as SGLang's ``/metrics`` would (running and waiting sequences, the
fraction of KV blocks sequences reference, tokens generated per second since the last poll),
sampled every 10 simulated seconds from the first arrival (policy ``smg``). ``smg_dark`` is the
same rule with no report it can read — what smg does in front of the bundled engine live, whose
``/metrics`` has vLLM's gauge names and which smg detects as SGLang: join-shortest-queue for the
final pick, no veto (seen live: its ``GET /workers`` lists them as ``runtime_type: sglang`` and
``GET /loads`` has no entry). Prefixes are matched in engine blocks (16 tokens), not characters, and the
tree is never evicted (its cap is 2^26 characters per worker).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from engine.engine import LLMEngine
from kvrouter.replay.policies import Policy
from kvrouter.replay.trace import leading_run

__all__ = ["SmgPolicy"]


class _Report:
    """One worker's load as smg's monitor last read it."""

    __slots__ = ("running", "throughput", "usage", "waiting")

    def __init__(self, running: int, waiting: int, usage: float, throughput: float) -> None:
        self.running = running
        self.waiting = waiting
        self.usage = usage
        self.throughput = throughput


class SmgPolicy(Policy):
    """smg 1.13.0's cache_aware over HTTP workers (see the module docstring)."""

    name = "smg"
    CACHE_THRESHOLD = 0.3
    BALANCE_ABS = 64
    BALANCE_REL = 1.5
    MIN_ABSOLUTE_MARGIN = 4.0
    KV_PRESSURE_WEIGHT = 0.15
    MEAN_PREFILL_TOKENS = 1024
    DEFAULT_THROUGHPUT = 2000.0
    TIE_EPSILON_S = 1e-6
    POLL_S = 10.0
    OVERLOAD_WAITING = 8
    OVERLOAD_USAGE = 0.8

    def __init__(self, engines: Sequence[LLMEngine], seed: int, *, reports: bool = True) -> None:
        super().__init__(engines)
        n = len(engines)
        self.trees: list[set[int]] = [set() for _ in engines]
        self.rng = random.Random(seed)
        self.reports: list[_Report | None] = [None] * n
        self.vetoed = [False] * n
        self.since_tokens = [0] * n  # LeastLoad's since-poll dispatch credit
        self.since_requests = [0] * n
        self._generated = [0] * n
        self._polled_at: float | None = None
        if reports:
            self.poll_s = self.POLL_S
        else:
            self.name = "smg_dark"

    # ------------------------------------------------------------------ the load monitor

    def poll(self, now: float) -> None:
        """Read every engine's gauges as smg's monitor does, reset the credit, set the vetoes."""
        dt = None if self._polled_at is None else now - self._polled_at
        self._polled_at = now
        for w, engine in enumerate(self.engines):
            sched = engine.scheduler
            gen = engine.generation_tokens
            tput = (gen - self._generated[w]) / dt if dt else 0.0
            self._generated[w] = gen
            r = _Report(len(sched.running), len(sched.waiting), engine.bm.usage, tput)
            self.reports[w] = r
            self.since_tokens[w] = self.since_requests[w] = 0
            self.vetoed[w] = r.waiting >= self.OVERLOAD_WAITING or r.usage >= self.OVERLOAD_USAGE

    # ------------------------------------------------------------------ selection

    def choose(self, tokens: Sequence[int], now: float) -> tuple[int, Any]:
        load = self.outstanding
        eligible = [w for w in range(len(self.engines)) if not self.vetoed[w]]
        if not eligible:  # every worker over the veto: the least loaded, the policy bypassed
            return self._least_loaded(range(len(self.engines))), None
        avg = sum(load[w] for w in eligible) / len(eligible)
        bm = self.engines[0].bm
        hashes = bm.hash_blocks_of(tokens)
        matched = [leading_run(hashes, tree) for tree in self.trees]
        best = max(matched)
        group = [w for w in eligible if best and matched[w] == best]
        if group and best * bm.block_size > self.CACHE_THRESHOLD * len(tokens):
            safe = [w for w in group if not self._over_gate(load[w], avg)]
            if not safe:  # a spill: every eligible worker under the gate, else every one
                safe = [w for w in eligible if not self._over_gate(load[w], avg)] or eligible
        else:
            safe = eligible
        w = self._expected_wait(safe)
        self.trees[w].update(hashes)
        return w, None

    def _over_gate(self, load: float, avg: float) -> bool:
        margin = min(float(self.BALANCE_ABS), max(math.ceil(2.0 * math.sqrt(avg)),
                                                   self.MIN_ABSOLUTE_MARGIN))  # fmt: skip
        return load > avg * self.BALANCE_REL and load > avg + margin

    def _score(self, w: int) -> float:
        r = self.reports[w]
        if r is None:  # the whole fleet dark: in-flight requests
            return float(self.outstanding[w])
        p = self.MEAN_PREFILL_TOKENS
        reported = r.running + r.waiting
        unaccounted = max(0, self.outstanding[w] - reported - self.since_requests[w])
        queued = (r.waiting + r.running + unaccounted) * p
        tput = r.throughput if r.throughput > 0 else self.DEFAULT_THROUGHPUT
        k = min(max(r.usage, 0.0), 0.999)
        return (queued + self.since_tokens[w]) / tput + self.KV_PRESSURE_WEIGHT * k / (1.0 - k)

    def _expected_wait(self, candidates: Sequence[int]) -> int:
        """LeastLoad's argmin, ties within 1 µs drawn uniformly; credits the winner."""
        best, best_s, tied = candidates[0], self._score(candidates[0]), 1
        for w in candidates[1:]:
            s = self._score(w)
            if s < best_s - self.TIE_EPSILON_S:
                best, best_s, tied = w, s, 1
            elif abs(s - best_s) <= self.TIE_EPSILON_S:
                tied += 1
                best_s = min(best_s, s)
                if self.rng.randrange(tied) == 0:
                    best = w
        self.since_tokens[best] += self.MEAN_PREFILL_TOKENS
        self.since_requests[best] += 1
        return best

    def _least_loaded(self, workers: range) -> int:
        best, tied = workers[0], 0
        for w in workers[1:]:
            if self.outstanding[w] < self.outstanding[best]:
                best, tied = w, 0
            elif self.outstanding[w] == self.outstanding[best]:
                tied += 1
                if self.rng.randrange(tied + 1) == 0:
                    best = w
        return best
