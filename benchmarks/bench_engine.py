"""Torch runner benchmark: time to first token cold vs prefix-cached, load-back vs recompute, and
decode throughput — measured through the runner interface the engine drives.

    python benchmarks/bench_engine.py --device cpu                     # 2-layer d=256, 2k and 8k
    python benchmarks/bench_engine.py --device cuda                    # random-0.5b bf16, 2k/8k/32k
    python benchmarks/bench_engine.py --device cpu --lengths 2048 --repeats 5 --threads 2

For each prompt length N (block size B, blocks n = ceil(N / B)):

* cold TTFT: prefill of all N tokens (nothing cached), then the first token sampled;
* cached TTFT: the first n-1 blocks are in the device pool (prefix cache hit, "all blocks but
  the last"), only the rest is computed, attending to them;
* load-back TTFT: those n-1 blocks come back from CPU_PINNED host slots (a real host→device copy,
  timed to completion) and the rest is computed: what a lower-tier hit costs against recomputing;
* decode: tokens/s of greedy steps at batch 1 and 16 over a ``--decode-context`` token prompt.

Times are medians over ``--repeats`` runs after a warm-up. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine.runner.base import RunnerConfig, ScheduledSeq
from engine.torch_runner.runner import TorchRunner

DEFAULT_MODEL = {"cpu": "tiny-random:layers=2,d=256,heads=4,kv_heads=2", "cuda": "random-0.5b"}
DEFAULT_LENGTHS = {"cpu": "2048,8192", "cuda": "2048,8192,32768"}


def _seq(seq_id, tokens, computed, new, table, outputs=0) -> ScheduledSeq:
    return ScheduledSeq(
        seq_id=seq_id,
        token_ids=tokens,
        num_computed_tokens=computed,
        num_new_tokens=new,
        block_table=table,
        num_output_tokens=outputs,
    )


def _sync(runner: TorchRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _timed(runner: TorchRunner, fn) -> float:
    _sync(runner)
    t0 = time.perf_counter()
    fn()
    _sync(runner)
    return time.perf_counter() - t0


def bench_ttft(runner: TorchRunner, length: int, repeats: int, gen: torch.Generator) -> dict:
    bs = runner.block_size
    tokens = torch.randint(0, runner.vocab_size, (length,), generator=gen).tolist()
    nblocks = -(-length // bs)
    table = list(range(nblocks))
    cached = (nblocks - 1) * bs
    slots = list(range(nblocks - 1))

    def cold():
        runner.execute([_seq(1, tokens, 0, length, table)])

    def warm():
        runner.execute([_seq(1, tokens, cached, length - cached, table)])

    def load_back():
        runner.swap_in(list(zip(slots, table[: nblocks - 1]))).wait()
        runner.execute([_seq(1, tokens, cached, length - cached, table)])

    cold()  # warm-up, and the prefix KV the cached runs reuse
    runner.swap_out(list(zip(table[: nblocks - 1], slots))).wait()
    out = {"tokens": length, "cached_tokens": cached}
    for name, fn in (("cold", cold), ("cached", warm), ("load_back", load_back)):
        out[name] = statistics.median(_timed(runner, fn) for _ in range(repeats))
    return out


def bench_decode(
    runner: TorchRunner, batch: int, context: int, steps: int, gen: torch.Generator
) -> dict:
    bs = runner.block_size
    per_seq = -(-(context + steps + 1) // bs)
    seqs = []
    for i in range(batch):
        tokens = torch.randint(0, runner.vocab_size, (context,), generator=gen).tolist()
        table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append((tokens, table))
    out = runner.execute([_seq(i, t, 0, len(t), tb) for i, (t, tb) in enumerate(seqs)])
    for i, (t, _) in enumerate(seqs):
        t.append(out.tokens[i])

    def one_step(n: int):
        step = [_seq(i, t, len(t) - 1, 1, tb, outputs=n) for i, (t, tb) in enumerate(seqs)]
        got = runner.execute(step).tokens
        for i, (t, _) in enumerate(seqs):
            t.append(got[i])

    one_step(1)  # warm-up
    elapsed = _timed(runner, lambda: [one_step(n) for n in range(2, steps + 2)])
    return {
        "batch": batch,
        "context": context,
        "tok_s": batch * steps / elapsed,
        "step": elapsed / steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", help="preset spec or HF directory (default per device)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", help="comma-separated prompt lengths")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-batches", default="1,16")
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or DEFAULT_MODEL[args.device]
    lengths = [int(x) for x in (args.lengths or DEFAULT_LENGTHS[args.device]).split(",")]
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    bs = args.block_size
    per_decode = -(-(args.decode_context + args.decode_steps + 2) // bs)
    blocks = max([-(-n // bs) for n in lengths] + [max(batches, default=1) * per_decode])
    t0 = time.perf_counter()
    runner = TorchRunner(
        RunnerConfig(
            block_size=bs,
            num_gpu_blocks=blocks,
            num_host_slots=max(-(-n // bs) for n in lengths),
            model=model,
            options={"device": args.device, "dtype": args.dtype},
        )
    )
    load_s = time.perf_counter() - t0
    cfg = runner.model_config
    device = torch.cuda.get_device_name(runner.device) if args.device == "cuda" else "cpu"
    print(
        f"# torch runner on {device} ({torch.get_num_threads()} threads), {model}: "
        f"{cfg.num_parameters() / 1e6:.1f}M params, {cfg.num_layers} layers, d={cfg.hidden_size}, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads, {str(runner.dtype).removeprefix('torch.')}, "
        f"block {bs}, built in {load_s:.1f}s\n"
    )
    gen = torch.Generator().manual_seed(0)
    print(
        "| prompt tokens | cached tokens | cold TTFT ms | cached TTFT ms | cached/cold |"
        " load-back (CPU_PINNED) TTFT ms | load-back/cold |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        r = bench_ttft(runner, n, args.repeats, gen)
        print(
            f"| {n} | {r['cached_tokens']} | {r['cold'] * 1e3:.1f} | {r['cached'] * 1e3:.2f} |"
            f" {r['cached'] / r['cold']:.3f} | {r['load_back'] * 1e3:.2f} |"
            f" {r['load_back'] / r['cold']:.3f} |",
            flush=True,
        )
    print("\n| decode batch | context tokens | tokens/s | ms/step |")
    print("|---:|---:|---:|---:|")
    for b in batches:
        r = bench_decode(runner, b, args.decode_context, args.decode_steps, gen)
        print(f"| {b} | {r['context']} | {r['tok_s']:.0f} | {r['step'] * 1e3:.2f} |", flush=True)
    runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
