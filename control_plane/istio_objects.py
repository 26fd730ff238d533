"""The Istio objects this control plane gives istiod, from its settings: one builder for both
deliveries (MCP-over-xDS, mcp.py; Kubernetes objects written through the API server,
kube_writer.py), so both carry exactly what `meshcache istio render` previews."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshcache.contract import extensions
from meshcache.contract.oci import image_for, sha256_hex

from .settings import Settings

log = logging.getLogger("meshcache.control_plane.istio")
Obj = dict[str, Any]


def default_sha256(url: str, module_path: Path) -> str:
    """What istio-agent verifies: the image manifest digest for oci://, else the file's sha256."""
    if not module_path.is_file():
        return ""
    if url.startswith("oci://"):
        return image_for(module_path).digest
    return sha256_hex(module_path.read_bytes())


@dataclass(frozen=True)
class IstioObjects:
    mode: str  # full, native: EnvoyFilters; basic: TrafficExtensions
    namespace: str
    revision: str
    build: Callable[[Obj], list[Obj]]  # plugin config -> the objects (no namespace)

    @property
    def kind(self) -> str:
        return extensions.MODE_KIND[self.mode]

    @classmethod
    def from_settings(cls, settings: Settings) -> IstioObjects | None:
        """None when no module is configured (nothing is given to istiod): the Wasm module's URL,
        or in native mode the dynamic module's path in the sidecars."""
        mode = settings.istio_mode
        url, native = settings.istio_wasm_url, settings.istio_native_module
        if mode == "native" and not native:
            log.warning("MESHCACHE_CP_ISTIO_NATIVE_MODULE is not set: istiod gets no meshcache filter")
            return None
        if mode != "native" and not url:
            log.warning("MESHCACHE_CP_ISTIO_WASM_URL is not set: istiod gets no meshcache filter")
            return None
        sha = "" if mode == "native" else settings.istio_wasm_sha256 or default_sha256(url, settings.istio_module_path)
        colors = [c.strip() for c in settings.istio_color.split(",") if c.strip()] or [""]
        workloads = settings.istio_workloads()

        def build(plugin_config: Obj) -> list[Obj]:
            return extensions.objects(mode, colors=colors, url=url, sha256=sha, plugin_config=plugin_config,
                                      workloads=workloads, native_module=native)

        build({})  # a bad pin or mode fails at startup, not on the first policy change
        return cls(mode, settings.istio_namespace, settings.istio_revision, build)
