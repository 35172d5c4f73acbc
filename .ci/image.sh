#!/usr/bin/env bash
# CI stage: build the container image's two targets (router, engine) with podman and smoke-run
# them. No image registry is reachable here, so the base is made from Debian packages with
# mmdebstrap (python3 at /usr/bin) unless KVROUTER_BASE_IMAGE names one already present; the
# Dockerfile's default, python:3.11-slim-bookworm, works the same where a registry is reachable.
# podman's default OCI runtime cannot start containers on these machines: the checks run the
# image's own files through chroot in a podman-mounted container (tests/stages/image/).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null; then
  echo "image: installing podman and mmdebstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman mmdebstrap >/dev/null
fi

base=${KVROUTER_BASE_IMAGE:-localhost/kvrouter-base:bookworm}
if ! podman image exists "$base"; then
  echo "image: making the base $base from Debian bookworm (python3, python3-venv, ca-certificates)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$tmp/base.tar"
  podman import --quiet "$tmp/base.tar" "$base" >/dev/null
fi

# pip inside the build reaches PyPI through this machine's trust store (which may hold a TLS
# proxy's CA): handed to the build as a secret, so it is in no layer of the image
secret=()
if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
  secret=(--secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt)
fi
build() {  # target tag
  local t0=$SECONDS
  podman build --quiet --isolation chroot --format docker "${secret[@]}" \
    --build-arg BASE_IMAGE="$base" --target "$1" -t "$2" . >/dev/null
  echo "image: built target $1 as $2 in $((SECONDS - t0)) s"
}
build router localhost/kvrouter:ci
build engine localhost/kvrouter-engine:ci

export KVROUTER_IMAGE=localhost/kvrouter:ci KVROUTER_ENGINE_IMAGE=localhost/kvrouter-engine:ci
python -m pytest -q -p no:cacheprovider tests/stages/image
