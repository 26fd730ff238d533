"""The proxies connected over xDS and what each has acknowledged."""

from __future__ import annotations

from fastapi import APIRouter

from ...schemas import NackOut, ProxiesOut, ProxyOut
from ..dependencies import CP, Reader
from ..errors import ERRORS

router = APIRouter()


@router.get("/v1/proxies", responses=ERRORS)
async def proxies(cp: CP, _p: Reader) -> ProxiesOut:
    current = str(cp.cache.current.version)
    out = []
    for c in list(cp.xds.registry.connections.values()):
        acked, acked_at = c.acked_version()
        nack = c.last_nack
        out.append(ProxyOut(
            node_id=c.node_id, cluster=c.cluster, stream_id=c.stream_id, transport=c.transport,
            type_urls=sorted(c.acked), connected_since=c.connected_since, acked_version=acked,
            acked_at=acked_at, current=acked == current,
            last_nack=NackOut(version=nack.version, error=nack.error, at=nack.at) if nack else None,
        ))
    return ProxiesOut(version=cp.cache.current.version, proxies=out)
