"""Settings of prefill/decode disaggregation (``pd:``, docs/architecture.md §10): how the placement
core decides between prefilling on the decode worker (*local*) and on a prefill worker
(*remote*), and which exchange the doors speak. Part of :class:`router.settings.Settings`, kept
here so each module stays small. Roles are per worker (``WorkerConfig.role``)."""

from __future__ import annotations

import msgspec

from router.errors import config_check as _check

__all__ = ["PD_MODES", "PD_PROTOCOLS", "ROLES", "PdSettings"]

#: a worker's role: ``both`` serves whole requests and may take either leg
ROLES = ("prefill", "decode", "both")
#: how the placement core decides local against remote (``router.placement.pd``)
PD_MODES = ("threshold", "cost", "always", "never")
#: the exchange between the legs: vLLM's NIXL pull (``kv_transfer_params``, sequential),
#: SGLang's bootstrap fields (concurrent), a shared-storage connector (sequential, no params)
PD_PROTOCOLS = ("nixl", "sglang", "shared_storage")


class PdSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Prefill/decode disaggregation; inert while no worker has the role ``prefill``."""

    #: ``cost`` by default: it weighs both sides' queues and the decode batch it would stall, so a
    #: wrong P:D ratio degrades it gently where ``threshold`` sends nearly every prompt to too
    #: few prefill engines (docs/replay.md, the PD sweep)
    mode: str = "cost"
    protocol: str = "nixl"
    #: threshold mode: remote only when the decode worker lacks at least this many prompt tokens
    #: (vllm-router's ``pd_uncached_token_threshold`` is 256) ...
    min_remote_tokens: int = 256
    #: ... and at least this share of the prompt (Dynamo's ``isl_bounding`` keeps a request
    #: local below 0.7 *cached*; a share of 0.3 *uncached* is the same line)
    min_remote_ratio: float = 0.3
    #: cost mode: moving one token's KV, in prefill-token units (a fraction of computing it)
    transfer_cost: float = 0.1
    #: cost mode: the second leg's fixed price (a round trip, a handshake), in prompt tokens
    hop_cost_tokens: int = 64
    #: cost mode: how much more a prefill token on a decode worker costs per request there of
    #: ``stall_reference_tokens`` output tokens (it stalls every decoding sequence of the steps it
    #: lands in). A stall of t spreads over a sequence's output: TTFT objective / (output tokens x
    #: TPOT objective) prices it against this request's own wait: 2,000 ms / (L x 50 ms) for
    #: outputs of L = 150-350 tokens is 0.1-0.3
    decode_interference: float = 0.2
    #: cost mode: the answer length (output tokens) ``decode_interference`` prices; a request with
    #: ``max_tokens`` L counts this / (L - 1) requests of it (at most 4), one without counts 1: a
    #: stall of t adds t / (L - 1) to an answer's time per output token
    stall_reference_tokens: int = 200
    #: the prefill leg's deadline, under the prefill worker's block lease (vLLM: 30 s)
    prefill_timeout_s: float = 25.0
    #: prefill workers tried after the first fails (5xx or transport) before prefilling on D
    prefill_retries: int = 1

    def __post_init__(self) -> None:
        _check(self.mode in PD_MODES, "mode", f"must be one of {', '.join(PD_MODES)}")
        ok = self.protocol in PD_PROTOCOLS
        _check(ok, "protocol", f"must be one of {', '.join(PD_PROTOCOLS)}")
        _check(self.min_remote_tokens >= 0, "min_remote_tokens", "must be >= 0")
        _check(0 <= self.min_remote_ratio <= 1, "min_remote_ratio", "must be between 0 and 1")
        _check(self.transfer_cost >= 0, "transfer_cost", "must be >= 0")
        _check(self.hop_cost_tokens >= 0, "hop_cost_tokens", "must be >= 0")
        _check(self.decode_interference >= 0, "decode_interference", "must be >= 0")
        _check(self.stall_reference_tokens >= 1, "stall_reference_tokens", "must be >= 1")
        _check(self.prefill_timeout_s > 0, "prefill_timeout_s", "must be > 0")
        _check(0 <= self.prefill_retries <= 4, "prefill_retries", "must be between 0 and 4")
