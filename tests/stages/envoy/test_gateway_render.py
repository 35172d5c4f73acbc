"""``deploy/gateway`` rendered by a real kustomize (``kubectl kustomize``; ``KUBECTL`` names the
binary) and compared, object for object, with the composition the main suite checks against the
code (``tests/integration/deploy/test_gateway_manifests.py``). Skipped without a kubectl whose
kustomize can read a directory in ``resources:`` (>= 3), as ``.ci/kubernetes.sh`` does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "integration" / "deploy"))
from test_gateway_manifests import GATEWAY, validate  # noqa: E402
from test_kubernetes_manifests import compose  # noqa: E402

KUBECTL = os.environ.get("KUBECTL") or shutil.which("kubectl") or ""


def _kustomize_major() -> int:
    if not KUBECTL:
        return 0
    out = subprocess.run(
        [KUBECTL, "version", "--client"], capture_output=True, text=True, timeout=30
    ).stdout
    m = re.search(r"^Kustomize Version: v(\d+)", out, re.M)
    return int(m.group(1)) if m else 0


@pytest.mark.skipif(_kustomize_major() < 3, reason="no kubectl with kustomize >= 3")
def test_kustomize_renders_the_gateway_as_composed() -> None:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(GATEWAY)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    rendered = [d for d in yaml.safe_load_all(out) if d]
    for obj in rendered:
        validate(obj)
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert {key(o): o for o in rendered} == {key(o): o for o in compose(GATEWAY)}
    assert {"InferencePool", "HTTPRoute"} <= {o["kind"] for o in rendered}
