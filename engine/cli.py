"""``kvrouter engine`` / ``python -m engine``: flags → settings → uvicorn, plus router registration.

Options this parser does not know (``--prefill-a 2e-6`` for sim, future torch flags) are passed
to the runner as ``RunnerConfig.options`` (``--some-flag v`` → ``{"some_flag": "v"}``; a bare flag
→ True); the runner rejects those it does not know. Once listening it prints one line that
``kvrouter up`` parses::

    kvrouter engine ready http=http://127.0.0.1:PORT events=tcp://127.0.0.1:P replay=tcp://127.0.0.1:Q role=both kv=127.0.0.1:R

(``kv=``: the block endpoint of a ``prefill`` or ``both`` engine as its prefill answers name it,
``--kv-advertise-host``, :mod:`engine.pd`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn

from engine.config import ConfigError, EngineConfig, ServerSettings
from engine.register import RegistrationError, deregister, register

__all__ = ["TORCH_DECODE_STAGING", "build_parser", "main", "parse_args"]

#: a torch decode engine's default staging slots: 1,024 blocks (16k tokens at block size 16),
#: about 200 MB pinned for a 0.5B model's 12 KiB of KV a token
TORCH_DECODE_STAGING = 1024

log = logging.getLogger("engine.cli")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter engine",
        description="Bundled KV cache engine: OpenAI server + KV events (vLLM wire format).",
        allow_abbrev=False,
    )
    a = p.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8001, help="HTTP port, 0 = any free port")
    a("--events", default="tcp://127.0.0.1:5557", help="ZMQ PUB endpoint ('none' disables)")
    a("--replay", default="tcp://127.0.0.1:5558", help="ZMQ ROUTER replay endpoint ('none')")
    a("--topic", default="kv-events")
    a("--dp-rank", type=int, default=0)
    a("--replay-buffer", type=int, default=10000, help="messages kept for replay")
    a("--runner", default="sim", choices=("sim", "torch"))
    a("--model", help="torch: HF directory or tiny-random[:layers=2,d=256,...]; sim: a label")
    a("--served-model-name", help="model name in the API (default: from --model)")
    a("--device", choices=("auto", "cuda", "cpu"), help="torch runner device")
    a("--dtype", choices=("auto", "bfloat16", "float16", "float32"), help="torch runner dtype")
    a("--tokenizer", help="a local tokenizer.json (default: the model's, else bytes)")
    a("--block-size", type=int, default=16)
    a("--gpu-blocks", type=int, default=2048)
    a("--cpu-blocks", type=int, default=0, help="CPU_PINNED tier size in blocks")
    a(
        "--staging-blocks",
        type=int,
        help="host slots for DISK/EXTERNAL copies and pulled KV, which loads through them chunk "
        "by chunk (default: 64; a decode engine's: --gpu-blocks with the sim runner, at most "
        f"{TORCH_DECODE_STAGING} with the torch runner, whose slots are pinned KV blocks)",
    )
    a("--disk-dir", help="DISK tier directory (emptied at start)")
    a("--disk-blocks", type=int, default=8192)
    a("--external", help="EXTERNAL tier on Redis: redis://HOST:PORT/DB")
    a("--external-dir", help="EXTERNAL tier in a directory shared by several engines")
    a("--external-blocks", type=int, help="bound on the EXTERNAL blocks this engine claims")
    a("--offload", default="write-through", choices=("write-through", "write-back"))
    a("--max-num-batched-tokens", type=int, default=2048)
    a("--max-num-seqs", type=int, default=64)
    a("--max-model-len", type=int)
    a("--no-prefix-caching", action="store_true")
    a("--speedup", type=float, default=1.0, help="divide every sim delay by this")
    a("--seed", type=int, default=0)
    a("--register", metavar="ROUTER_URL", help="POST /workers there once up, DELETE on exit")
    a("--worker-id", help="id to register under (default engine-PORT)")
    a("--pool", help="EXTERNAL pool group name to register with")
    a("--advertise-url", help="URL the router uses to reach this engine")
    a(
        "--stream-head",
        default="first-token",
        choices=("first-token", "at-once"),
        help="send a streamed answer's head with its first token, or at once as vLLM does",
    )
    a(
        "--role",
        default="both",
        choices=("prefill", "decode", "both"),
        help="prefill/decode disaggregation: the legs of vLLM's NIXL exchange this engine takes",
    )
    a("--kv-host", help="the prefill side's block endpoint address (default: --host)")
    a("--kv-port", type=int, default=0, help="the block endpoint's port (0: any free port)")
    a(
        "--kv-advertise-host",
        help="the address prefill answers give the decode engine for the block endpoint "
        "(remote_host; vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST). Default: the bound --kv-host/--host, "
        "or this host's own address (the pod IP) when that is 0.0.0.0 or ::",
    )
    a(
        "--kv-lease-s",
        type=float,
        default=30.0,
        help="seconds a prefill engine holds a transfer's blocks (vLLM's kv_lease_duration)",
    )
    a(
        "--kv-load-failure-policy",
        default="fail",
        choices=("fail", "recompute"),
        help="a decode leg whose pull fails: answer 500, or prefill here (vLLM's)",
    )
    a("--kv-pull-timeout-s", type=float, default=10.0)
    a("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def _runner_options(extra: Sequence[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ConfigError(f"unexpected argument {tok!r}")
        name, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                value = extra[i + 1]
                i += 1
            else:
                value = True  # type: ignore[assignment]
        opts[name.replace("-", "_")] = value
        i += 1
    return opts


def _endpoint(value: str | None) -> str | None:
    return None if value is None or value.lower() in ("", "none", "off") else value


def _staging_blocks(args: argparse.Namespace) -> int:
    """A decode leg loads pulled blocks through staging slots, chunk by chunk as loads give
    them back (engine.scheduler). Each chunk waits for the one before, so a decode engine
    stages more than 64: with the sim runner as many as the GPU holds (a slot is a few bytes:
    a pulled prompt loads in one go, as in session 22's live figures), with the torch runner at
    most :data:`TORCH_DECODE_STAGING` (a slot is one KV block of pinned host memory: as many as
    the GPU holds would pin the GPU's KV size again in RAM)."""
    if args.staging_blocks is not None:
        return int(args.staging_blocks)
    if args.role != "decode":
        return 64
    if args.runner == "torch":
        return max(64, min(args.gpu_blocks, TORCH_DECODE_STAGING))
    return max(64, args.gpu_blocks)


def parse_args(argv: Sequence[str]) -> tuple[ServerSettings, argparse.Namespace]:
    args, extra = build_parser().parse_known_args(list(argv))
    options = _runner_options(extra)
    for key in ("device", "dtype"):
        if getattr(args, key):
            options[key] = getattr(args, key)
    engine = EngineConfig(
        runner=args.runner,
        model=args.model,
        served_model_name=args.served_model_name,
        runner_options=options,
        block_size=args.block_size,
        num_gpu_blocks=args.gpu_blocks,
        num_cpu_blocks=args.cpu_blocks,
        num_staging_slots=_staging_blocks(args),
        disk_dir=args.disk_dir,
        num_disk_blocks=args.disk_blocks,
        external_url=args.external,
        external_dir=args.external_dir,
        num_external_blocks=args.external_blocks,
        offload=args.offload,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        speedup=args.speedup,
        seed=args.seed,
        tokenizer=args.tokenizer,
        kv_lease_s=args.kv_lease_s,
    )
    settings = ServerSettings(
        engine=engine,
        host=args.host,
        port=args.port,
        events=_endpoint(args.events),
        replay=_endpoint(args.replay),
        topic=args.topic,
        dp_rank=args.dp_rank,
        replay_buffer=args.replay_buffer,
        register=args.register,
        worker_id=args.worker_id,
        admin_key=os.environ.get("KVROUTER_ADMIN_KEY") or None,
        advertise_url=args.advertise_url,
        stream_head=args.stream_head,
        role=args.role,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_advertise_host=args.kv_advertise_host,
        kv_load_failure_policy=args.kv_load_failure_policy,
        kv_pull_timeout_s=args.kv_pull_timeout_s,
    )
    return settings, args


class _Server(uvicorn.Server):
    """Prints the ready line once bound, registers with the router, and leaves it on exit."""

    def __init__(self, config: uvicorn.Config, settings: ServerSettings, pool: str | None) -> None:
        super().__init__(config)
        self.settings = settings
        self.pool = pool
        self.registered: tuple[str, str] | None = None

    def _bound(self) -> tuple[str, int]:
        for server in getattr(self, "servers", []):
            for sock in server.sockets or ():
                name = sock.getsockname()
                return name[0], name[1]
        return self.config.host, self.config.port

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        host, port = self._bound()
        url = self.settings.advertise_url or f"http://{f'[{host}]' if ':' in host else host}:{port}"
        st = self.config.app.state.kv  # type: ignore[union-attr]
        print(
            f"kvrouter engine ready http={url} events={st.events_endpoint or 'none'} "
            f"replay={st.replay_endpoint or 'none'} role={self.settings.role}"
            + (" kv={}:{}".format(*st.pd.advertised) if st.pd.advertised else ""),
            flush=True,
        )
        if self.settings.register:
            worker_id = self.settings.worker_id or f"engine-{port}"
            try:
                await register(
                    self.settings.register,
                    worker_id=worker_id,
                    url=url,
                    events=st.events_endpoint,
                    replay=st.replay_endpoint,
                    model=st.model,
                    pool=self.pool,
                    admin_key=self.settings.admin_key,
                )
            except RegistrationError as exc:
                log.error("%s", exc)
                self.should_exit = True
                return
            self.registered = (self.settings.register, worker_id)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.registered is not None:
            try:
                await deregister(*self.registered, admin_key=self.settings.admin_key)
            except RegistrationError as exc:
                log.warning("%s", exc)
            self.registered = None
        await super().shutdown(sockets)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings, args = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"kvrouter engine: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from engine.engine import LLMEngine
    from engine.runner import RunnerError
    from engine.server import create_app
    from engine.stores import TierError

    try:  # fail before serving: a bad runner option or an unreachable store is a start error
        core = LLMEngine(settings.engine)
    except (RunnerError, TierError, ValueError) as exc:
        print(f"kvrouter engine: {exc}", file=sys.stderr)
        return 1
    config = uvicorn.Config(
        create_app(settings, core_factory=lambda: core),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = _Server(config, settings, args.pool)
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1
