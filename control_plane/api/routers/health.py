"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from ...schemas import ErrorOut
from ..dependencies import CP
from ..errors import error_response

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorOut}})
async def readyz(cp: CP) -> Any:
    if await cp.store.ping():
        return {"status": "ready", "version": cp.cache.current.version}
    return error_response(503, "Redis unreachable")


@router.get("/metrics", response_class=Response)
async def metrics(cp: CP) -> Response:
    return Response(cp.metrics.render(), media_type="text/plain; version=0.0.4")
