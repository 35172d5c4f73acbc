"""The bundled engine says its KV cache's size on /metrics as vLLM does
(``vllm:cache_config_info``), with the DISK and EXTERNAL tiers vLLM has no label for, and the
router reads it (``router.fleet.capacity``) to cap the worker's entries in its index."""

from __future__ import annotations

from pathlib import Path

import httpx
from engine_helpers import serve

from engine.config import EngineConfig, ServerSettings
from engine.server import create_app
from router.fleet.capacity import parse_kv_capacity, rank_capacities


async def _capacity(engine: EngineConfig, dp_rank: int = 0) -> dict:
    settings = ServerSettings(
        engine=engine, events="tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0", dp_rank=dp_rank
    )
    async with serve(create_app(settings)) as url, httpx.AsyncClient(base_url=url) as c:
        text = (await c.get("/metrics")).text
    assert "# TYPE vllm:cache_config_info gauge" in text
    return parse_kv_capacity(text)


async def test_engine_metrics_carry_its_tier_sizes(tmp_path: Path) -> None:
    found = await _capacity(
        EngineConfig(
            num_gpu_blocks=300,
            num_cpu_blocks=40,
            disk_dir=str(tmp_path / "disk"),
            num_disk_blocks=900,
            external_dir=str(tmp_path / "ext"),
            num_external_blocks=5000,
            speedup=100.0,
        )
    )
    assert found == {0: {"GPU": 300, "CPU_PINNED": 40, "DISK": 900, "EXTERNAL": 5000}}


async def test_engine_without_lower_tiers_and_on_another_dp_rank() -> None:
    found = await _capacity(EngineConfig(num_gpu_blocks=128, speedup=100.0), dp_rank=2)
    assert found == {2: {"GPU": 128, "CPU_PINNED": 0}}
    assert rank_capacities(found, 1) == [{"GPU": 128, "CPU_PINNED": 0}]
