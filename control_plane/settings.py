"""Control-plane settings: command-line flags override MESHCACHE_CP_* environment variables."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from meshcache.paths import FILTER_WASM


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHCACHE_CP_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    host: str = "127.0.0.1"
    http_port: int = Field(8080, ge=0, le=65535)
    xds_port: int = Field(18000, ge=0, le=65535)
    # Where Envoy finds the filter module: must equal the static default_config's path so the
    # pushed VM config is identical and Envoy reuses the VM (and its cache).
    wasm_path: Path = FILTER_WASM
    # Token entries `role:name:token` (role is read or write), one per line in the file and
    # comma- or newline-separated in MESHCACHE_CP_TOKENS.
    tokens_file: Path | None = None
    tokens: str = ""
    # Redis key namespace, so several deployments (or tests) can share one Redis.
    key_prefix: str = "meshcache:cp"
    instance_id: str = Field(default_factory=lambda: socket.gethostname())
    # Bounds.
    max_policies: int = Field(1000, ge=1, le=4096)  # the filter accepts at most 4096
    snapshot_retention: int = Field(1000, ge=10, le=100_000)
    audit_maxlen: int = Field(10_000, ge=100, le=1_000_000)
    max_request_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    redis_timeout_s: float = Field(1.0, gt=0, le=30)
    # Pub/sub is lossy across reconnects; a cheap periodic version check closes the gap.
    resync_interval_s: float = Field(1.0, gt=0, le=60)
    max_xds_streams: int = Field(5000, ge=1, le=100_000)
    # MCP-over-xDS for istiod (control_plane/mcp.py): the WasmPlugin `<istio_namespace>/meshcache`.
    istio_namespace: str = Field("meshcache", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    istio_color: str = ""  # pluginConfig.color and selector label `color`; empty: every colour
    istio_wasm_url: str = ""  # e.g. oci://registry/meshcache/filter@sha256:<digest>; empty: no WasmPlugin
    # For oci:// the image manifest digest (what Istio verifies), else the module's sha256. Empty:
    # computed from istio_module_path.
    istio_wasm_sha256: str = Field("", pattern=r"^([a-f0-9]{64})?$")
    istio_module_path: Path = FILTER_WASM
    istio_revision: str = ""  # adds the `istio.io/rev` label (istiod only takes its own revision)
