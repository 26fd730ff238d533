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


@router.get("/metrics", response_class=Response)
async def metrics(cp: CP) -> Response:
    return Response(cp.metrics.render(), media_type="text/plain; version=0.0.4")
