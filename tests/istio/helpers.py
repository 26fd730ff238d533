"""The committed Istio kustomizations the tests build and check."""

from __future__ import annotations

import os
import re
from pathlib import Path

from meshcache.ctl.istio import render

ISTIO_DIR = render.ISTIO_DIR
OVERLAYS = sorted(p.parent for p in (ISTIO_DIR / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [render.BASE_DIR, *OVERLAYS]
# Overlays in front of the user's own servers (no meshcache engine): cross-referenced against
# manifests of those workloads in tests/istio/test_existing_servers.py.
FRONT_OVERLAYS = [p for p in OVERLAYS if p.name in ("kserve", "triton")]
OWN_ENGINE_KUSTOMIZATIONS = [p for p in KUSTOMIZATIONS if p not in FRONT_OVERLAYS]

# The real kustomize, built by scripts/setup.sh (KUSTOMIZE_VERSION there).
KUSTOMIZE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshcache" / "tools" / \
    "kustomize-v5.8.2" / "kustomize"

# The real Helm, built by scripts/setup.sh at its HELM_VERSION (the one pin), and meshcache's chart.
HELM_VERSION = re.search(r"^HELM_VERSION=(v[0-9.]+)$", (render.REPO_ROOT / "scripts" / "setup.sh").read_text(),
                         re.MULTILINE).group(1)  # type: ignore[union-attr]
HELM = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshcache" / "tools" / \
    f"helm-{HELM_VERSION}" / "helm"
CHART = render.REPO_ROOT / "charts" / "meshcache"
