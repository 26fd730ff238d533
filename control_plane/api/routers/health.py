"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from ...schemas import ErrorOut, ReadyOut
from ..dependencies import CP, serving_out
from ..errors import error_response

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorOut}}, response_model=ReadyOut)
async def readyz(cp: CP) -> Any:
    """Ready while a snapshot is served: from the store, or (degraded, still ready) the last good
    one from memory or the state file while the store is unreachable; 503 while none is known
    (control_plane/README.md, "Never less than the last good snapshot", argues why)."""
    serving = serving_out(cp)
    if serving.version is None:
        return error_response(503, serving.detail)
    return ReadyOut(status="degraded" if serving.degraded else "ready", version=serving.version, serving=serving)


async def _xds(cp: CP, kind: str) -> Any:
    results = await cp.probe.check(kind)
    failed = [f"xDS process {i}: {r.error}" for i, r in enumerate(results) if not r.ok]
    if failed:
        return error_response(503, "; ".join(failed))
    return {"status": "ok", "round_trip_ms": max(r.elapsed_ms for r in results), "processes": len(results)}


@router.get("/healthz/xds", responses={503: {"model": ErrorOut}})
async def healthz_xds(cp: CP) -> Any:
    """Liveness: every xDS process answers an ADS stream (istiod's MeshConfig request) within a
    second. A wedged event loop or a stopped process fails it (xds_probe.py)."""
    return await _xds(cp, "live")


@router.get("/readyz/xds", responses={503: {"model": ErrorOut}})
async def readyz_xds(cp: CP) -> Any:
    """Readiness for istiod: every xDS process answers each kind istiod needs to sync from
    this pod, within a second. Independent of Redis (the control plane serves what it has)."""
    return await _xds(cp, "ready")


@router.get("/metrics", response_class=Response)
async def metrics(cp: CP) -> Response:
    return Response(cp.metrics.render(), media_type="text/plain; version=0.0.4")
