"""The sidecars istiod configures, as istiod reports them (`/debug/syncz` on its monitoring port,
:15014 in a cluster), for `/v1/proxies` and the status page.

Under Istio the sidecars are not connected here: istiod is (an MCP client, listed apart as a
config client). A sidecar's row takes the policy version istiod has ACKed from this control plane
once istiod's syncz shows the sidecar's ECDS push ACKed with no error; a NACK is its last NACK.
Until then it keeps the version last seen ACKed. syncz carries istiod's push versions, not
meshcache's, so between istiod's ACK of a new snapshot and its debounced push (PILOT_DEBOUNCE_AFTER,
100 ms by default) a sidecar may show the new version early.

Bounded: one read per `cache_s`, the answer at most MAX_SYNCZ_BYTES and MAX_PROXIES sidecars, a
timeout; istiod unreachable is reported (`error`), never as sidecars gone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

ECDS_TYPE_URL = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
MAX_SYNCZ_BYTES = 8 << 20
MAX_PROXIES = 1000
TRANSPORT = "istiod"


class IstiodSyncConfigError(ValueError):
    pass


def check_url(url: str) -> str:
    """istiod's debug base URL, e.g. http://istiod.istio-system:15014/debug (empty: none)."""
    url = url.strip().rstrip("/")
    if url:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise IstiodSyncConfigError(f"istiod_debug: {url!r} is not an http(s) URL")
    return url


@dataclass
class SyncRead:
    entries: list[dict[str, Any]] = field(default_factory=list)  # /v1/proxies entries (fleet.proxy_entry's)
    error: str | None = None


class IstiodSync:
    def __init__(self, url: str, timeout_s: float = 2.0, cache_s: float = 1.0) -> None:
        self.url = check_url(url)
        self.timeout_s, self.cache_s = timeout_s, cache_s
        self._read: tuple[float, str, SyncRead] | None = None  # (when, for which istiod version, what)
        self._last_acked: dict[str, tuple[str, float]] = {}  # proxy -> (policy version, when seen ACKed)
        self._client: httpx.AsyncClient | None = None

    async def _syncz(self) -> list[dict[str, Any]]:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
        async with self._client.stream("GET", f"{self.url}/syncz") as r:
            if r.status_code != 200:
                raise ValueError(f"istiod {self.url}/syncz: HTTP {r.status_code}")
            body = b""
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_SYNCZ_BYTES:
                    raise ValueError(f"istiod {self.url}/syncz: more than {MAX_SYNCZ_BYTES} bytes")
        rows = json.loads(body) or []
        if not isinstance(rows, list):
            raise ValueError(f"istiod {self.url}/syncz: not a list")
        return [r for r in rows if isinstance(r, dict)]

    async def read(self, istiod_acked: str) -> SyncRead:
        """The sidecars with an ECDS stream at istiod (`istiod_acked`: the policy version istiod
        has ACKed from this control plane, "" if none)."""
        if not self.url:
            return SyncRead()
        now = time.time()
        if self._read is not None and self._read[1] == istiod_acked and now - self._read[0] < self.cache_s:
            return self._read[2]
        try:
            rows = await self._syncz()
        except (httpx.HTTPError, ValueError) as exc:
            out = SyncRead(error=f"istiod syncz unreadable: {exc or type(exc).__name__}")
        else:
            out = SyncRead(entries=[e for e in (self._entry(r, istiod_acked, now) for r in rows[:MAX_PROXIES]) if e])
            seen = {e["node_id"] for e in out.entries}
            self._last_acked = {p: v for p, v in self._last_acked.items() if p in seen}
        self._read = (now, istiod_acked, out)
        return out

    def _entry(self, row: dict[str, Any], istiod_acked: str, now: float) -> dict[str, Any] | None:
        proxy = row.get("proxy")
        resources = row.get("resources")
        if not isinstance(proxy, str) or not isinstance(resources, dict) or ECDS_TYPE_URL not in resources:
            return None  # no ECDS stream: no meshcache filter there (a gateway without it, say)
        ecds = resources[ECDS_TYPE_URL] if isinstance(resources[ECDS_TYPE_URL], dict) else {}
        error = ecds.get("lastError")
        nack = None
        if error:
            nack = {"version": str(ecds.get("sent", "")), "error": str(error)[:1024], "at": now}
        elif istiod_acked and ecds.get("acked") and ecds.get("acked") == ecds.get("sent"):
            self._last_acked[proxy] = (istiod_acked, now)
        acked, acked_at = self._last_acked.get(proxy, ("", None))
        return {"node_id": proxy, "cluster": str(row.get("cluster_id", "")), "stream_id": 0,
                "transport": TRANSPORT, "type_urls": sorted(resources), "resources": [],
                "connected_since": 0.0, "acked_version": acked, "acked_at": acked_at,
                "replica": f"istiod {self.url}", "last_nack": nack}

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
