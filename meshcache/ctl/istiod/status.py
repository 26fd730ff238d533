"""What istiod and its sidecars report: per-proxy sync state (istiod's `/debug/syncz`) and the
policy version a sidecar runs (its ECDS config). Used by the istiod mesh, `meshcache status` and
`meshcache demo` (which may only have the URLs of a running mesh)."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import httpx

from meshcache.contract.wasm_filter import FILTER_NAME

ECDS_TYPE_URL = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
# basic mode: istiod names a TrafficExtension's ECDS resource after the object
TRAFFIC_EXTENSION_ECDS_PREFIX = "extensions.istio.io/trafficextension/"


def syncz(istiod_debug: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    r = httpx.get(f"{istiod_debug}/syncz", timeout=timeout)
    r.raise_for_status()
    return r.json() or []  # type: ignore[no-any-return]


def proxy_sync(istiod_debug: str) -> list[dict[str, Any]]:
    """Per connected proxy: each xDS type as ACKED, SENT (not acknowledged yet) or NACKED (with
    the proxy's error), as istiod tracks them; `synced` when every type is ACKED."""
    out = []
    for status in syncz(istiod_debug):
        types = {}
        for type_url, res in sorted(status.get("resources", {}).items()):
            short = type_url.rsplit(".", 1)[-1]
            if res.get("lastError"):
                types[short] = f"NACKED: {res['lastError']}"
            else:
                types[short] = "ACKED" if res.get("acked") and res.get("acked") == res.get("sent") else "SENT"
        out.append({"proxy": status.get("proxy", ""), "istio_version": status.get("istio_version", ""),
                    "synced": bool(types) and all(v == "ACKED" for v in types.values()), "types": types})
    return out


def ecds_filters(admin: str) -> list[dict[str, Any]]:
    """The ECDS filter configs in a sidecar's config_dump (`admin`: its admin URL)."""
    r = httpx.get(f"{admin}/config_dump", timeout=10)
    r.raise_for_status()
    return [item for c in r.json().get("configs", []) if c.get("@type", "").endswith("EcdsConfigDump")
            for item in c.get("ecds_filters", [])]


def ecds_version(admin: str) -> int:
    """The policy snapshot version in the sidecar's meshcache filter config (0 = none yet). The
    config_dump shows the last config received, a NACKed one too: see `acked`."""
    return policy_version(ecds_filters(admin))


def policy_version(filters: list[dict[str, Any]]) -> int:
    """The policy snapshot version in the meshcache filter config among ECDS `filters` (0 = none)."""
    for item in filters:
        ecds = item.get("ecds_filter", {})
        name = ecds.get("name", "")
        if not (name == FILTER_NAME or name.startswith(TRAFFIC_EXTENSION_ECDS_PREFIX)):
            continue
        typed = ecds.get("typed_config", {})
        # The Wasm filter's `config.configuration`, or the dynamic module's `filter_config` (native).
        value = (typed.get("config", {}).get("configuration") or typed.get("filter_config") or {}).get("value", "")
        with contextlib.suppress(ValueError):
            v = json.loads(value).get("version", "0")
            return int(v) if str(v).isdigit() else 0
    return 0


def acked(istiod_debug: str, proxy_id: str, admin: str, version: int) -> bool:
    """The sidecar runs policy `version` (or later) and istiod has its ACK, no NACK pending."""
    if ecds_version(admin) < version:
        return False
    for status in syncz(istiod_debug):
        if status.get("proxy") == proxy_id:
            res = status.get("resources", {}).get(ECDS_TYPE_URL, {})
            return bool(res.get("acked")) and res.get("acked") == res.get("sent") and not res.get("lastError")
    return False


def wait_applied(istiod_debug: str, sidecars: dict[str, str], version: int, timeout: float = 30.0) -> None:
    """Until every sidecar (proxy id -> admin URL) runs `version`; TimeoutError naming the rest."""
    deadline = time.monotonic() + timeout
    pending = dict(sidecars)
    while pending and time.monotonic() < deadline:
        pending = {p: a for p, a in pending.items() if not acked(istiod_debug, p, a, version)}
        if pending:
            time.sleep(0.05)
    if pending:
        raise TimeoutError(f"policy version {version} not applied by {', '.join(pending)} within {timeout:.0f}s")
