"""The proxies connected over xDS, to this replica and to the others (fleet.py), and what each
has acknowledged."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ...schemas import NackOut, ProxiesOut, ProxyOut
from ..dependencies import CP, Reader
from ..errors import ERRORS

router = APIRouter()


@router.get("/v1/proxies", responses=ERRORS)
async def proxies(cp: CP, _p: Reader) -> ProxiesOut:
    current = str(cp.cache.current.version)
    mesh = await cp.mesh_proxies()

    def out(e: dict[str, Any]) -> ProxyOut:
        return ProxyOut(**{**e, "last_nack": NackOut(**e["last_nack"]) if e["last_nack"] else None},
                        current=e["acked_version"] == current)

    return ProxiesOut(version=cp.cache.current.version, replica=cp.fleet.replica, complete=mesh.complete,
                      proxies=[out(e) for e in mesh.proxies], config_clients=[out(e) for e in mesh.config_clients],
                      istiod_error=mesh.istiod_error)
