"""Engine and server settings: plain frozen dataclasses, validated once at start."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Any

from engine.pd.params import LOAD_FAILURE_POLICIES, ROLES
from indexer.hosts import is_wildcard

__all__ = ["ConfigError", "EngineConfig", "ServerSettings"]


class ConfigError(ValueError):
    """An invalid setting; the message names the flag."""


@dataclass(frozen=True)
class EngineConfig:
    runner: str = "sim"
    #: ``--model``: the runner's model (torch: HF directory or ``tiny-random[:...]``; sim: a label).
    model: str | None = None
    #: Name served in the OpenAI API (``--served-model-name``).
    served_model_name: str | None = None
    runner_options: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    num_gpu_blocks: int = 2048
    num_cpu_blocks: int = 0
    #: Host slots used to stage DISK/EXTERNAL copies (not a tier; never published).
    num_staging_slots: int = 64
    disk_dir: str | None = None
    num_disk_blocks: int = 8192
    external_url: str | None = None
    external_dir: str | None = None
    #: Bound on the EXTERNAL blocks this engine claims (None: the store's own retention).
    num_external_blocks: int | None = None
    offload: str = "write-through"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    speedup: float = 1.0
    seed: int = 0
    #: A local ``tokenizer.json`` (default: the runner's, else the byte tokenizer).
    tokenizer: str | None = None
    #: how long a prefill engine holds a transfer's blocks for the decode engine (vLLM's
    #: ``kv_lease_duration``, 30 s)
    kv_lease_s: float = 30.0

    def __post_init__(self) -> None:
        positive = {
            "--block-size": self.block_size,
            "--gpu-blocks": self.num_gpu_blocks,
            "--max-num-batched-tokens": self.max_num_batched_tokens,
            "--max-num-seqs": self.max_num_seqs,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{flag} must be positive, got {value}")
        if self.num_cpu_blocks < 0 or self.num_staging_slots < 0:
            raise ConfigError("--cpu-blocks must be >= 0")
        if self.disk_dir is not None and self.num_disk_blocks <= 0:
            raise ConfigError("--disk-blocks must be positive")
        if self.external_url and self.external_dir:
            raise ConfigError("give --external or --external-dir, not both")
        if self.num_external_blocks is not None and self.num_external_blocks <= 0:
            raise ConfigError("--external-blocks must be positive")
        if self.offload not in ("write-through", "write-back"):
            raise ConfigError("--offload must be write-through or write-back")
        if self.speedup <= 0:
            raise ConfigError("--speedup must be positive")
        if self.kv_lease_s <= 0:
            raise ConfigError("--kv-lease-s must be positive")
        if self.max_model_len is not None and not (
            0 < self.max_model_len <= self.num_gpu_blocks * self.block_size
        ):
            raise ConfigError(
                f"--max-model-len must be in (0, {self.num_gpu_blocks * self.block_size}]"
                " (the GPU cache size in tokens)"
            )

    @property
    def model_len(self) -> int:
        """Longest sequence (prompt + output) the GPU cache can hold."""
        return self.max_model_len or self.num_gpu_blocks * self.block_size

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return (
                os.path.basename(os.path.normpath(self.model))
                if os.path.isdir(self.model)
                else self.model
            )
        return "kvrouter-sim" if self.runner == "sim" else "tiny-random"


@dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8001
    #: ZMQ PUB endpoint (``None``: no events). Port 0 or ``*`` binds a free port.
    events: str | None = "tcp://127.0.0.1:5557"
    replay: str | None = "tcp://127.0.0.1:5558"
    topic: str = "kv-events"
    dp_rank: int = 0
    replay_buffer: int = 10000
    #: Router to register with (``POST /workers``) once serving, and leave on shutdown.
    register: str | None = None
    worker_id: str | None = None
    admin_key: str | None = None
    #: URL the router should use to reach this engine (default: http://host:port as bound).
    advertise_url: str | None = None
    #: when a streamed answer's head goes: with the first token ("first-token": an error the
    #: engine finds at admission is an HTTP status, as SGLang does too), or "at-once", before the
    #: prefill, as vLLM sends it (that error is then an SSE error event)
    stream_head: str = "first-token"
    #: prefill/decode disaggregation (``engine.pd``): ``prefill`` takes prefill legs and serves
    #: their blocks, ``decode`` pulls them, ``both`` does either; all serve whole requests
    role: str = "both"
    #: the block endpoint's address (prefill and both); None: ``host``. Port 0: any free port
    kv_host: str | None = None
    kv_port: int = 0
    #: the block endpoint's address in prefill answers (``remote_host``); None: the bound one, or
    #: this host's own address if that is a wildcard (engine.pd.side_channel.advertised_host)
    kv_advertise_host: str | None = None
    #: a decode leg whose pull fails: answer 500 (``fail``, vLLM's default) or prefill here
    kv_load_failure_policy: str = "fail"
    kv_pull_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {', '.join(ROLES)}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(
                f"--kv-load-failure-policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}"
            )
        if self.kv_pull_timeout_s <= 0:
            raise ConfigError("--kv-pull-timeout-s must be positive")
        if not 0 <= self.kv_port < 65536:
            raise ConfigError("--kv-port must be a port number")
        if self.kv_advertise_host is not None and not _connectable(self.kv_advertise_host):
            raise ConfigError(
                f"--kv-advertise-host must be an address or host name a decode engine can "
                f"connect to (an IPv6 address without brackets), not {self.kv_advertise_host!r}"
            )
        if self.stream_head not in ("first-token", "at-once"):
            raise ConfigError("--stream-head must be first-token or at-once")
        if self.replay_buffer <= 0:
            raise ConfigError("--replay-buffer must be positive")
        if self.dp_rank < 0:
            raise ConfigError("--dp-rank must be >= 0")


_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _connectable(host: str) -> bool:
    """One IP address or DNS name that is not a wildcard bind (no port, brackets or scheme)."""
    if is_wildcard(host):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return len(host) <= 253 and _HOST_NAME.fullmatch(host) is not None
    return True
