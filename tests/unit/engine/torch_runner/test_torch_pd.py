"""The torch runner as a prefill/decode pair of real processes: the decode engine pulls real KV
tensors from the prefill engine's block endpoint, and its greedy output is token for token that
of one aggregated engine (float32: exact equality). The decode engine stages through 4 slots, so
every prompt of more than 4 full blocks loads chunk by chunk, and none is computed again there."""

from __future__ import annotations

from typing import Any

from torch_helpers import DEVICE, TINY, prompt

from tests.unit.engine.pd_helpers import PREFILL_LEG, engines, gpu_stores

BLOCK = 4
TORCH = ["--runner", "torch", "--model", TINY, "--dtype", "float32", "--device", DEVICE]
TORCH += ["--block-size", str(BLOCK), "--gpu-blocks", "128", "--seed", "0"]


def _body(ids: list[int], **kw: Any) -> dict[str, Any]:
    return {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}


def test_a_torch_pd_pair_generates_what_one_aggregated_engine_does() -> None:
    # lengths around the block size: nothing to pull (3, 4), one block, several, a longer one
    prompts = [prompt(n, seed=40 + n) for n in (3, 4, 5, 9, 17, 33, 61)]
    decode = ["--role", "decode", "--staging-blocks", "4", *TORCH]
    with engines(["--role", "prefill", *TORCH], decode, TORCH) as (p, d, a):
        for ids in prompts:
            whole = a.post(_body(ids))
            leg = p.post(_body(ids, max_tokens=1, kv_transfer_params=PREFILL_LEG))
            assert leg.status_code == 200, leg.text
            kv = leg.json()["kv_transfer_params"]
            got = d.post(_body(ids, kv_transfer_params=kv))
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"], ids
        pulled = sum((len(ids) - 1) // BLOCK for ids in prompts)
        side = d.transfers()
        assert side["pulls"]["pulled"] == len(prompts) and side["loaded_blocks"] == pulled
        assert p.transfers()["leases"]["held"] == 0
        stored = gpu_stores(d.replay)  # BlockStored(GPU) for each pulled block, with its tokens
        for ids in prompts:
            for i in range((len(ids) - 1) // BLOCK):
                assert ids[i * BLOCK : (i + 1) * BLOCK] in stored
