"""The proxies connected over xDS, to this replica and to the others (fleet.py), and what each
has acknowledged."""

from __future__ import annotations

from fastapi import APIRouter

from ...schemas import NackOut, ProxiesOut, ProxyOut
from ..dependencies import CP, Reader
from ..errors import ERRORS

router = APIRouter()


@router.get("/v1/proxies", responses=ERRORS)
async def proxies(cp: CP, _p: Reader) -> ProxiesOut:
    current = str(cp.cache.current.version)
    entries, complete = await cp.fleet.all()
    out = [ProxyOut(**{**e, "last_nack": NackOut(**e["last_nack"]) if e["last_nack"] else None},
                    current=e["acked_version"] == current) for e in entries]
    return ProxiesOut(version=cp.cache.current.version, replica=cp.fleet.replica, complete=complete, proxies=out)
