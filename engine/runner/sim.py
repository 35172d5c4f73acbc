"""The ``sim`` runner: no tensors, a timing model, and fake KV bytes that check themselves.

Timing (milliseconds, every sleep divided by ``--speedup``; defaults roughly fitted to a ~0.5B
model in bf16 on one mid-range GPU, override with runner options of the same name):

* a step with prefill work: ``prefill_a·Σ n² + prefill_b·Σ n + prefill_c`` over the tokens ``n``
  each prefilling sequence computes (cached tokens cost nothing);
* a step with decoding sequences adds ``decode_d0 + decode_d1·batch + decode_d2·context``, where
  ``context`` is the number of tokens those sequences attend to: on a GPU a decode step reads the
  KV of every cached token of its batch, so long requests piled on one worker slow every step.
  ``decode_d2`` = ``kv_bytes_per_token`` / HBM bandwidth: 12,288 B / 600 GB/s ≈ 2e-5 ms a token
  (a 100k-token batch adds 2 ms to an 8 ms step);
* a host↔GPU copy of ``k`` blocks: ``k·block_bytes / cpu_gbps + cpu_latency_ms``; a DISK/EXTERNAL
  read: ``bytes / {disk,external}_gbps + {disk,external}_latency_ms`` (``io_delay``), with
  ``block_bytes = kv_bytes_per_token · block_size``; a decode engine's pull of ``k`` blocks from a
  prefill engine (tier ``REMOTE``, :mod:`engine.pd`): ``k·block_bytes / transfer_gbps +
  transfer_latency_ms``.

KV bytes: each GPU block and host slot holds a small payload — a digest chained over the tokens
of every block up to it, as real KV depends on the whole prefix. ``execute`` checks the payload of
every block a sequence attends to and raises :class:`RunnerError` on a mismatch, so an engine bug
that loses, misplaces or corrupts a block (or loads a wrong one back) fails loudly in sim tests.
Sampled tokens are a deterministic function of that digest (greedy) or of ``(seed, position,
digest)``, drawn from ``[token_min, token_max]`` (printable ASCII by default).

``timing_only=True`` (virtual-time replay, ``kvrouter.replay.virtual``): no sleeps, no payloads,
no checks — only the modeled step time, which the caller advances its own clock by — and sampled
tokens a cheap function of the sequence and position. Copies are done at once and a block read
from the host is a placeholder: the caller times a copy itself, on its own clock, with
:meth:`SimRunner.copy_s` (the virtual replay's prefill→decode pulls), so no wall-clock wait
enters a simulated run. Only for engines without lower tiers (staging slots for pulls only).

Every step also counts the prefill it ran (:attr:`SimRunner.prefill_tokens`, and the longest
chunk one sequence prefilled in one step, :attr:`SimRunner.longest_prefill`): what a decode
engine of a PD fleet must keep small.
"""

from __future__ import annotations

import hashlib
import random
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from engine.runner.base import (
    DoneTransfer,
    ModelRunner,
    RunnerConfig,
    RunnerError,
    ScheduledSeq,
    StepOutput,
    Transfer,
)

__all__ = ["SIM_DEFAULTS", "SimRunner", "SimTransfer"]

SIM_DEFAULTS: dict[str, float] = {
    "prefill_a": 2e-6,
    "prefill_b": 0.03,
    "prefill_c": 4.0,
    "decode_d0": 8.0,
    "decode_d1": 0.15,
    "decode_d2": 2e-5,
    "kv_bytes_per_token": 12288.0,
    "cpu_gbps": 25.0,
    "cpu_latency_ms": 0.01,
    "disk_gbps": 3.0,
    "disk_latency_ms": 0.1,
    "external_gbps": 1.25,
    "external_latency_ms": 0.5,
    # a prefill→decode KV pull (engine.pd): a 100 Gb/s link, plus the handshake
    "transfer_gbps": 12.5,
    "transfer_latency_ms": 1.0,
    "token_min": 32.0,
    "token_max": 126.0,
    # prompt ids the sim accepts (any tokenizer's); it only ever emits [token_min, token_max]
    "vocab_size": 262144.0,
}

_MAGIC = b"SIMKV1"
_DIGEST = 16
_CACHED_SEQS = 4096
_PLACEHOLDER = _MAGIC + bytes(_DIGEST)


def _chain(prev: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=_DIGEST)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class SimTransfer(Transfer):
    """Done when the modeled copy time has passed on the wall clock."""

    def __init__(self, elapsed_s: float, speedup: float) -> None:
        self.elapsed_s = elapsed_s
        self._deadline = time.monotonic() + elapsed_s / speedup

    def done(self) -> bool:
        return time.monotonic() >= self._deadline

    def wait(self) -> None:
        delay = self._deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class SimRunner(ModelRunner):
    name = "sim"

    def __init__(self, config: RunnerConfig, *, timing_only: bool = False) -> None:
        self.timing_only = timing_only
        if config.speedup <= 0:
            raise RunnerError("--speedup must be positive")
        params = dict(SIM_DEFAULTS)
        for key, value in config.options.items():
            if key not in SIM_DEFAULTS:
                known = ", ".join(sorted(SIM_DEFAULTS))
                raise RunnerError(f"unknown sim runner option {key!r} (known: {known})")
            try:
                params[key] = float(value)
            except (TypeError, ValueError) as exc:
                raise RunnerError(f"sim runner option {key!r} must be a number") from exc
        self.p = params
        self.block_size = config.block_size
        self.num_gpu_blocks = config.num_gpu_blocks
        self.num_host_slots = config.num_host_slots
        self.speedup = config.speedup
        lo, hi = int(params["token_min"]), int(params["token_max"])
        if not 0 <= lo <= hi:
            raise RunnerError("token_min/token_max must satisfy 0 <= min <= max")
        self._lo, self._span = lo, hi - lo + 1
        self.vocab_size = max(256, hi + 1, int(params["vocab_size"]))
        self._rng = random.Random(config.seed)
        self._gpu: list[bytes] = [b""] * self.num_gpu_blocks
        self._host: list[bytes] = [b""] * self.num_host_slots
        self._full: OrderedDict[int, list[bytes]] = OrderedDict()
        self.modeled_block_bytes = int(params["kv_bytes_per_token"] * self.block_size)
        self._model = config.model
        #: Total modeled compute time of every step so far (seconds, before speedup).
        self.busy_s = 0.0
        #: prompt tokens prefilled so far, and the most one sequence prefilled in one step
        self.prefill_tokens = 0
        self.longest_prefill = 0
        #: the wall clock a live step is timed on (a test injects its own)
        self.clock: Callable[[], float] = time.monotonic
        self.sleep: Callable[[float], None] = time.sleep

    @property
    def kv_block_bytes(self) -> int:
        return len(_MAGIC) + _DIGEST

    @property
    def kv_fingerprint(self) -> str:
        # sim engines labelled with the same --model share EXTERNAL blocks; others never do
        return f"sim:{self._model}:{self.block_size}"

    # ------------------------------------------------------------------ timing model

    def prefill_ms(self, tokens: Sequence[int] | int) -> float:
        """Modeled prefill time of one step whose prefilling sequences compute ``tokens``."""
        ns = [tokens] if isinstance(tokens, int) else list(tokens)
        p = self.p
        return p["prefill_a"] * sum(n * n for n in ns) + p["prefill_b"] * sum(ns) + p["prefill_c"]

    def decode_ms(self, batch: int, context: int = 0) -> float:
        """Modeled decode time of a step with ``batch`` decoding sequences attending to
        ``context`` tokens in all."""
        p = self.p
        return p["decode_d0"] + p["decode_d1"] * batch + p["decode_d2"] * context

    def copy_s(self, num_blocks: int, tier: str = "CPU_PINNED") -> float:
        """Modeled seconds to move ``num_blocks`` between GPU and ``tier``."""
        key = {"CPU_PINNED": "cpu", "DISK": "disk", "EXTERNAL": "external", "REMOTE": "transfer"}[
            tier
        ]
        nbytes = num_blocks * self.modeled_block_bytes
        return nbytes / (self.p[f"{key}_gbps"] * 1e9) + self.p[f"{key}_latency_ms"] / 1e3

    # ------------------------------------------------------------------ step

    def _digests(self, s: ScheduledSeq, upto: int) -> list[bytes]:
        """Payload digest of each block covering positions ``[0, upto)``. Full-block digests are
        cached per sequence (its tokens only ever grow), so a step hashes only new blocks."""
        bs = self.block_size
        full = self._full.pop(s.seq_id, None) or []
        self._full[s.seq_id] = full  # most recently used last
        if len(self._full) > _CACHED_SEQS:
            self._full.popitem(last=False)
        while len(full) < upto // bs:
            j = len(full)
            full.append(_chain(full[-1] if full else b"", s.token_ids[j * bs : (j + 1) * bs]))
        out = full[: upto // bs]
        if upto % bs:
            start = upto - upto % bs
            out.append(_chain(out[-1] if out else b"", s.token_ids[start:upto]))
        return out

    def execute(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        if self.timing_only:
            return self._execute_timed(seqs)
        t0 = self.clock()
        tokens: dict[int, int] = {}
        prefill: list[int] = []
        decode = context = 0
        for s in seqs:
            end = s.num_computed_tokens + s.num_new_tokens
            if s.num_new_tokens <= 0 or end > len(s.token_ids):
                raise RunnerError(
                    f"seq {s.seq_id}: bad step range {s.num_computed_tokens}+{s.num_new_tokens}"
                )
            if len(s.block_table) * self.block_size < end:
                raise RunnerError(f"seq {s.seq_id}: block table too short for {end} tokens")
            # what the attended blocks must hold (a partial last block: its computed part)
            for j, want in enumerate(self._digests(s, s.num_computed_tokens)):
                if self._gpu[s.block_table[j]] != _MAGIC + want:
                    raise RunnerError(
                        f"sim KV check failed: seq {s.seq_id} block {j} (gpu block "
                        f"{s.block_table[j]}) does not hold the KV of its prefix"
                    )
            digests = self._digests(s, end)
            for j in range(s.num_computed_tokens // self.block_size, len(digests)):
                self._gpu[s.block_table[j]] = _MAGIC + digests[j]
            if s.num_output_tokens == 0 or s.num_new_tokens > 1:
                prefill.append(s.num_new_tokens)
            else:
                decode += 1
                context += end
            if s.sample:
                tokens[s.seq_id] = self._sample(s, digests[-1])
        elapsed = self._elapsed(prefill, decode, context)
        # a step lasts its modeled time: the checks above stand in for a GPU's host-side work,
        # which overlaps its kernels, so their time comes out of the wait instead of adding to
        # it. Added, they made a live step slower the more context its batch held (0.7 ms per
        # 100k tokens: 40 % on top of the model's own context term, 1.6 ms at speedup 1.25)
        wait = elapsed / self.speedup - (self.clock() - t0)
        if wait > 0:
            self.sleep(wait)
        return StepOutput(tokens=tokens, elapsed_s=elapsed)

    def _elapsed(self, prefill: list[int], decode: int, context: int) -> float:
        if prefill:
            self.prefill_tokens += sum(prefill)
            self.longest_prefill = max(self.longest_prefill, max(prefill))
        ms = (self.prefill_ms(prefill) if prefill else 0.0) + (
            self.decode_ms(decode, context) if decode else 0.0
        )
        self.busy_s += ms / 1e3
        return ms / 1e3

    def _execute_timed(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        """``timing_only``: the step's modeled time and cheap tokens, nothing else."""
        tokens: dict[int, int] = {}
        prefill: list[int] = []
        decode = context = 0
        for s in seqs:
            if s.num_output_tokens == 0 or s.num_new_tokens > 1:
                prefill.append(s.num_new_tokens)
            else:
                decode += 1
                context += s.num_computed_tokens + 1
            if s.sample:
                x = (s.seq_id * 0x9E3779B1 + s.num_output_tokens * 0x85EBCA77) >> 7
                tokens[s.seq_id] = self._lo + x % self._span
        return StepOutput(tokens=tokens, elapsed_s=self._elapsed(prefill, decode, context))

    def _sample(self, s: ScheduledSeq, digest: bytes) -> int:
        sp = s.sampling
        if sp.temperature <= 0:
            x = int.from_bytes(digest[:8], "big")
        elif sp.seed is not None:
            x = random.Random(f"{sp.seed}:{s.num_output_tokens}:{digest.hex()}").getrandbits(64)
        else:
            x = self._rng.getrandbits(64)
        return self._lo + x % self._span

    # ------------------------------------------------------------------ transfers

    def _check(self, pairs: Sequence[tuple[int, int]], gpu_first: bool) -> None:
        for a, b in pairs:
            g, h = (a, b) if gpu_first else (b, a)
            if not (0 <= g < self.num_gpu_blocks and 0 <= h < self.num_host_slots):
                raise RunnerError(f"transfer out of range: gpu block {g}, host slot {h}")

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        self._check(pairs, True)
        if self.timing_only:  # (the caller times copies: see the module docstring)
            return DoneTransfer()
        for g, h in pairs:
            self._host[h] = self._gpu[g]
        return SimTransfer(self.copy_s(len(pairs)), self.speedup) if pairs else DoneTransfer()

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> Transfer:
        self._check(pairs, False)
        if self.timing_only:
            return DoneTransfer()
        for h, g in pairs:
            self._gpu[g] = self._host[h]
        return SimTransfer(self.copy_s(len(pairs)), self.speedup) if pairs else DoneTransfer()

    def read_host(self, slot: int) -> bytes:
        if self.timing_only:  # no payloads: a block the size of one, that nothing checks
            return _PLACEHOLDER
        data = self._host[slot]
        if len(data) != self.kv_block_bytes:
            raise RunnerError(f"host slot {slot} holds no KV")
        return data

    def write_host(self, slot: int, data: bytes) -> None:
        if len(data) != self.kv_block_bytes or not data.startswith(_MAGIC):
            raise RunnerError(f"not a sim KV block ({len(data)} bytes)")
        self._host[slot] = bytes(data)

    def io_delay(self, tier: str, num_bytes: int, *, write: bool = False) -> float:
        if write or self.timing_only or tier not in ("DISK", "EXTERNAL", "REMOTE"):
            return 0.0
        return self.copy_s(-(-num_bytes // self.kv_block_bytes), tier)
