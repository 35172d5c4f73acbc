# syntax=docker/dockerfile:1
# kvrouter container images. Two targets:
#   router (the default, last stage):  docker build -t kvrouter .
#   engine (bundled engine, sim runner; torch runner with --build-arg WITH_TORCH=1):
#                                      docker build --target engine -t kvrouter-engine .
# BASE_IMAGE is any Debian-based image with python3 (>= 3.10) and its venv module: the official
# python:3.11-slim-bookworm (python at /usr/local/bin) or Debian's own python3 (/usr/bin), e.g. one
# made offline with mmdebstrap (.ci/image.sh does that). The C accelerators are compiled in the
# builder stage; the final stages copy the virtualenv and carry no compiler.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------- builder
FROM ${BASE_IMAGE} AS builder
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# gcc for indexer/_chash.c and router/_native.c; Python.h comes with the python:* images, and from
# python3-dev on a Debian python3
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && if ! python3 -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
        apt-get install -y --no-install-recommends python3-dev; \
    fi \
 && rm -rf /var/lib/apt/lists/*
# the venv lives at the same path in every stage, so its interpreter links stay valid.
# pip behind a TLS-intercepting proxy: pass its CA bundle as a build secret (never stored in a layer)
#   --secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && python3 -m venv /opt/kvrouter && /opt/kvrouter/bin/pip install --upgrade pip wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvrouter kvrouter
COPY indexer indexer
COPY router router
COPY engine engine
# one wheel with both extensions compiled; fail the build if either was skipped (they are
# optional in setup.py so a compiler-less pip install still works, but an image must have them)
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && /opt/kvrouter/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/kvrouter/bin/pip install "$(ls /wheels/kvrouter-*.whl)[k8s,epp]" \
 && cd / && /opt/kvrouter/bin/python -c "import indexer._chash, router._native" \
 && /opt/kvrouter/bin/pip uninstall -y wheel setuptools \
 && /opt/kvrouter/bin/python -m pip uninstall -y pip \
 && find /opt/kvrouter -name __pycache__ -prune -exec rm -rf {} + \
 && /opt/kvrouter/bin/python -m compileall -q /opt/kvrouter/lib

# ----------------------------------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime
# a fixed numeric uid, so Kubernetes' runAsNonRoot can check it without a passwd lookup
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvrouter
COPY --from=builder /opt/kvrouter /opt/kvrouter
ENV PATH=/opt/kvrouter/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
ENTRYPOINT ["kvrouter"]

# ------------------------------------------------------------------------------------------ engine
FROM runtime AS engine
# WITH_TORCH=1 adds the torch runner: torch 2.13.0 CPU build, from the index that carries it
# (the venv has no pip: ensurepip brings one for this step only)
ARG WITH_TORCH=0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
USER 0
RUN --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi \
 && if [ "$WITH_TORCH" = 1 ]; then \
        python -m ensurepip --default-pip \
     && python -m pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
     && python -m pip install --no-cache-dir "safetensors>=0.4" "numpy>=1.26" \
     && python -m pip uninstall -y pip setuptools; \
    fi
USER 10001:10001
EXPOSE 8001 5557 5558
# the engine's HTTP, KV events (PUB) and replay (ROUTER) on every interface of the pod
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8001/health', timeout=2)"]
CMD ["engine", "--host", "0.0.0.0", "--port", "8001", "--events", "tcp://*:5557", "--replay", "tcp://*:5558"]

# ------------------------------------------------------------------------------------------ router
FROM runtime AS router
# a container's router answers on every interface (this overrides `host:` in a config file; set
# the port with KVROUTER_PORT so the HEALTHCHECK follows it)
ENV KVROUTER_HOST=0.0.0.0
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVROUTER_PORT', '8000'), timeout=2)"]
CMD ["serve"]
