"""The committed Istio kustomizations the tests build and check."""

from __future__ import annotations

from meshcache.ctl.istio import render

ISTIO_DIR = render.ISTIO_DIR
OVERLAYS = sorted(p.parent for p in (ISTIO_DIR / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [render.BASE_DIR, *OVERLAYS]
