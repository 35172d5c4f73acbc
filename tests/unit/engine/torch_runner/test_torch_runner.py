"""``TorchRunner`` through the engine's runner interface (tiny model, on the test device).

Tolerances: last-token logits after a cached or loaded-back prefix equal a full prefill's to
``atol=1e-4`` in float32 (O(1..10) logits), looser in bfloat16 (``PAGED_TOL``, CUDA only); KV
bytes, and greedy and seeded token sequences (float32 only), are compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch_helpers import (
    AUTO_DTYPE,
    BLOCK,
    DEVICE,
    DTYPES,
    PAGED_TOL,
    TINY,
    dtype_name,
    generate,
    make_runner,
    prompt,
    step,
)

from engine.runner import RunnerError, SamplingParams
from engine.runner import make_runner as engine_make_runner
from engine.runner.base import RunnerConfig

PROMPT_LEN = 22


def _logits(runner, *seqs):
    return runner.forward_logits(list(seqs))


def _full_prefill_logits(runner, ids, table):
    return _logits(runner, step(1, ids, 0, len(ids), table))


def _clobber(runner, blocks):
    """Overwrite device blocks with another prompt's KV, as reuse by another request would."""
    other = prompt(len(blocks) * BLOCK, seed=99)
    runner.execute([step(9, other, 0, len(other), blocks)])


def _suffix_logits(runner, ids, cached, table):
    return _logits(runner, step(2, ids, cached, len(ids) - cached, table))


@pytest.fixture(scope="module", params=DTYPES, ids=dtype_name)
def runner(request):
    return make_runner(dtype=request.param)


def test_factory_builds_the_torch_runner_and_reports_its_layout():
    built = engine_make_runner(
        "torch",
        RunnerConfig(
            block_size=BLOCK,
            num_gpu_blocks=8,
            num_host_slots=2,
            model=TINY,
            options={"device": DEVICE},
        ),
    )
    assert built.name == "torch" and built.vocab_size == 97
    assert built.dtype == AUTO_DTYPE  # no dtype option: float32 on CPU, bfloat16 on CUDA
    # 2 layers x (K, V) x 4 tokens x 2 kv heads x 16 dims x the dtype's bytes
    assert built.kv_block_bytes == 2 * 2 * BLOCK * 2 * 16 * AUTO_DTYPE.itemsize
    same = make_runner(dtype=AUTO_DTYPE)
    assert built.kv_fingerprint == same.kv_fingerprint
    other = make_runner(TINY.replace("seed=5", "seed=6"), dtype=AUTO_DTYPE)
    assert other.kv_fingerprint != same.kv_fingerprint  # other weights: never share KV


@pytest.mark.parametrize("cached", [8, 10, 20])  # on, off and on a block boundary
@pytest.mark.parametrize("tier", ["GPU", "CPU_PINNED", "DISK", "EXTERNAL"])
def test_prefill_after_load_back_matches_full_prefill(runner, tier, cached, tmp_path):
    ids = prompt(PROMPT_LEN, seed=cached)
    nblocks = -(-PROMPT_LEN // BLOCK)
    src = list(range(0, nblocks))
    full = _full_prefill_logits(runner, ids, src)
    held = -(-cached // BLOCK)  # blocks holding the prefix (the last one partial when off)
    target = runner  # where the suffix is computed
    if tier == "GPU":
        table = src[:held] + list(range(40, 40 + nblocks - held))
    else:
        slots = list(range(held))
        out = runner.swap_out(list(zip(src[:held], slots)))
        out.wait()
        assert out.done()
        _clobber(runner, src)
        if tier in ("DISK", "EXTERNAL"):
            files = []
            for slot in slots:
                path = tmp_path / f"block-{slot}.kv"
                path.write_bytes(runner.read_host(slot))
                files.append(path)
            if tier == "EXTERNAL":
                # the store is shared: a second engine with the same fingerprint loads it
                target = make_runner(gpu_blocks=32, host_slots=8, dtype=runner.dtype)
                assert target.kv_fingerprint == runner.kv_fingerprint
            else:
                runner.pool.host.zero_()  # the host copy is gone; only the files remain
            slots = [s + 3 for s in slots]  # land in other slots than they left from
            for slot, path in zip(slots, files):
                target.write_host(slot, path.read_bytes())
        table = list(range(20, 20 + nblocks))
        back = target.swap_in(list(zip(slots, table[:held])))
        back.wait()
        assert back.done() and back.elapsed_s >= 0
    got = _suffix_logits(target, ids, cached, table)
    torch.testing.assert_close(got, full, **PAGED_TOL[runner.dtype])


def test_load_back_restores_exact_bytes(runner):
    ids = prompt(8, seed=4)
    runner.execute([step(1, ids, 0, 8, [5, 6])])
    before = runner.pool.gpu[:, :, [5, 6]].clone()
    runner.swap_out([(5, 1), (6, 2)]).wait()
    data = [runner.read_host(1), runner.read_host(2)]
    assert all(len(d) == runner.kv_block_bytes for d in data)
    runner.write_host(7, data[0])
    runner.write_host(4, data[1])
    runner.swap_in([(7, 12), (4, 11)]).wait()
    assert torch.equal(runner.pool.gpu[:, :, [12, 11]], before)


def test_greedy_decode_is_identical_with_and_without_prefix_caching():
    runner = make_runner()
    ids = prompt(PROMPT_LEN, seed=7)
    cold = generate(runner, ids, list(range(0, 10)), 8)
    # same prompt again: the first five full blocks come from the first request's blocks
    shared = list(range(0, 5))
    warm = generate(runner, ids, [*shared, 30, 31, 32, 33, 34], 8, computed=5 * BLOCK)
    assert warm == cold
    # chunked prefill (no sample after the first chunk) gives the same tokens too
    table = list(range(40, 50))
    runner.execute([step(1, ids, 0, 9, table, sample=False)])
    chunked = generate(runner, ids, table, 8, computed=9)
    assert chunked == cold
    assert len(set(cold)) > 1  # a random model that repeats one token would prove little


def test_greedy_decode_is_identical_across_a_preemption():
    runner = make_runner()
    ids = prompt(PROMPT_LEN, seed=8)
    straight = generate(runner, ids, list(range(0, 10)), 10)
    table = list(range(10, 20))
    first = generate(runner, ids, table, 4)
    _clobber(runner, table)  # preempted: its blocks go to another request
    # recompute: the prompt and the 4 generated tokens prefill into fresh blocks
    rest = generate(runner, ids + first, list(range(30, 40)), 10, outputs=4)
    assert first + rest == straight


def test_batched_decode_matches_each_sequence_alone():
    runner = make_runner()
    a, b = prompt(13, seed=10), prompt(6, seed=11)
    alone_a = generate(runner, a, [0, 1, 2, 3, 4], 5)
    alone_b = generate(runner, b, [5, 6, 7], 5)
    sa, sb = list(a), list(b)
    ta, tb = [10, 11, 12, 13, 14], [15, 16, 17]
    got = runner.execute([step(1, sa, 0, len(sa), ta), step(2, sb, 0, len(sb), tb)]).tokens
    for i in range(1, 5):
        sa.append(got[1])
        sb.append(got[2])
        seqs = [
            step(1, sa, len(sa) - 1, 1, ta, outputs=i),
            step(2, sb, len(sb) - 1, 1, tb, outputs=i),
        ]
        got = runner.execute(seqs).tokens
    sa.append(got[1])
    sb.append(got[2])
    assert sa[len(a) :] == alone_a and sb[len(b) :] == alone_b


def test_seeded_sampling_is_reproducible_across_preemption_and_seed_dependent():
    runner = make_runner()
    ids = prompt(10, seed=12)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    straight = generate(runner, ids, [0, 1, 2, 3, 4], 8, sampling=params)
    head = generate(runner, ids, [10, 11, 12, 13, 14], 3, sampling=params)
    tail = generate(runner, ids + head, [20, 21, 22, 23, 24], 8, outputs=3, sampling=params)
    assert head + tail == straight
    other = generate(runner, ids, [0, 1, 2, 3, 4], 8, sampling=SamplingParams(1.0, 0.95, 99))
    assert other != straight


def test_execute_reports_sampled_tokens_only_and_elapsed_time(runner):
    ids = prompt(9, seed=13)
    out = runner.execute([step(3, ids, 0, 5, [0, 1, 2], sample=False)])
    assert out.tokens == {} and out.elapsed_s > 0
    out = runner.execute([step(3, ids, 5, 4, [0, 1, 2])])
    assert set(out.tokens) == {3} and 0 <= out.tokens[3] < runner.vocab_size


def test_bad_requests_raise_runner_errors(runner):
    with pytest.raises(RunnerError, match="bytes"):
        runner.write_host(0, b"\0" * (runner.kv_block_bytes - 1))
    with pytest.raises(RunnerError, match="vocabulary"):
        runner.execute([step(1, [1, 2, 500], 0, 3, [0])])
    with pytest.raises(RunnerError, match="block table"):
        runner.execute([step(1, list(range(9)), 0, 9, [0, 1])])
    with pytest.raises(RunnerError, match="transfer"):
        runner.swap_out([(0, 10_000)])
    with pytest.raises(RunnerError, match="option"):
        engine_make_runner(
            "torch",
            RunnerConfig(block_size=4, num_gpu_blocks=4, num_host_slots=0, options={"x": 1}),
        )
    with pytest.raises(RunnerError, match="preset"):
        make_runner("no-such-model")
