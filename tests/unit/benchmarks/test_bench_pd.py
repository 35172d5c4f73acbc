"""``benchmarks/bench_pd.py``: its direct PD legs are byte for byte the router's own
(``router.edge.legs``), and a short run measures the four ways end to end — a run that would
compare a direct path with different bodies from the router's measures nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import bench_pd
import pd_client
import pd_worker

from router.edge.legs import answer_params, apply, decode_patch, prefill_patch


@pytest.mark.parametrize("stream", [False, True])
def test_the_direct_legs_are_the_routers_legs(stream: bool) -> None:
    body = bench_pd.request_bodies(200, stream, count=1)[0]
    assert bench_pd.prefill_body(body) == apply(body, prefill_patch("nixl"))
    answer, _ = pd_worker.answers("prefill")
    params = answer_params(answer)
    assert params is not None and params["do_remote_prefill"] is True
    routed = apply(body, decode_patch("nixl"), {"kv_transfer_params": params})
    assert bench_pd.decode_body(body, answer) == routed


def test_the_workers_sse_is_whole_and_dechunked() -> None:
    _, sse = pd_worker.answers("decode")
    assert sse.endswith(b"data: [DONE]\n\n")
    assert sse.count(b"data: ") == 16 + 2  # the tokens, the usage, DONE
    chunked = b"5\r\nhello\r\n3;x=1\r\n ok\r\n0\r\n\r\n"
    assert pd_client._chunked_done(chunked, 0)
    assert not pd_client._chunked_done(chunked[:9], 0)
    assert pd_client._dechunk(chunked) == b"hello ok"


@pytest.mark.slow
def test_a_short_run_measures_all_four_ways(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "pd.png"
    argv = ["--seconds", "0.3", "--rounds", "1", "--rate", "400", "--stream", "--plot", str(png)]
    bench_pd.main(argv)  # (it checks the router's legs against the direct ones first)
    out = capsys.readouterr().out
    for title in ("non-streamed, sequential", "streamed, sequential"):
        assert title in out
    for name in (*bench_pd.NAMES.values(), "PD added", "proxy overhead", "ratio"):
        assert out.count(name) == 2, name
    assert "target <= 2x" in out
    assert png.stat().st_size > 0 or "matplotlib" not in sys.modules
    msgspec.json.decode(pd_worker.answers("prefill")[0])  # (the fixed answers are JSON)
