"""The overlays of ``deploy/kubernetes/`` rendered by a real kustomize (``kubectl kustomize``, the
one embedded in kubectl; ``KUBECTL`` names the binary), every rendered object validated against the
Kubernetes schemas, and the render compared with the composition that the main suite's
``tests/integration/deploy`` checks against the code — so those checks hold for what kustomize
really produces.

    KUBECTL=kubectl python -m pytest -q tests/stages/kubernetes
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "integration" / "deploy"))
from test_kubernetes_manifests import K8S, KUBE_VERSION, OVERLAYS, compose  # noqa: E402

KUBECTL = os.environ.get("KUBECTL", "kubectl")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_renders_the_overlay_as_composed(overlay: str) -> None:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    rendered = [d for d in yaml.safe_load_all(out) if d]
    for obj in rendered:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    composed = {key(o): o for o in compose(K8S / "overlays" / overlay)}
    assert {key(o): o for o in rendered} == composed
    print(f"\n{overlay}: {len(rendered)} objects rendered by {KUBECTL} kustomize, all valid")
