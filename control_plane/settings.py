"""Control-plane settings: command-line flags override MESHCACHE_CP_* environment variables."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from meshcache.contract.extensions import GRPC_PORT, HTTP_PORT, Workloads, parse_ports, parse_selector
from meshcache.contract.filter_config import (
    DEFAULT_SEMANTIC_TIMEOUT_MS,
    LIMIT_POLICIES,
    LIMIT_SEMANTIC_TIMEOUT_MS,
    SemanticService,
)
from meshcache.contract.paths import FILTER_NATIVE, FILTER_WASM


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHCACHE_CP_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    host: str = "127.0.0.1"
    http_port: int = Field(8080, ge=0, le=65535)
    xds_port: int = Field(18000, ge=0, le=65535)
    # Where Envoy finds the filter module: must equal the static default_config's path so the
    # pushed VM config is identical and Envoy reuses the VM (and its cache).
    wasm_path: Path = FILTER_WASM
    # Where Envoy finds the dynamic module (the native host, ECDS resource `meshcache-native`):
    # Envoys running it ask for that resource, the others for the Wasm one; both are always served.
    native_module: Path = FILTER_NATIVE
    # Token entries `role:name:token` (role is read or write), one per line in the file and
    # comma- or newline-separated in MESHCACHE_CP_TOKENS.
    tokens_file: Path | None = None
    tokens: str = ""
    # Where the last good snapshot is saved (state_file.py), so a restart without Redis serves it
    # instead of nothing; on Kubernetes an emptyDir (survives container restarts). None: not saved.
    state_dir: Path | None = None
    # Redis key namespace, so several deployments (or tests) can share one Redis.
    key_prefix: str = "meshcache:cp"
    instance_id: str = Field(default_factory=lambda: socket.gethostname())
    # Bounds.
    max_policies: int = Field(1000, ge=1, le=LIMIT_POLICIES)  # the filter's own ceiling
    snapshot_retention: int = Field(1000, ge=10, le=100_000)
    audit_maxlen: int = Field(10_000, ge=100, le=1_000_000)
    max_request_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    redis_timeout_s: float = Field(1.0, gt=0, le=30)
    # Pub/sub is lossy across reconnects; a cheap periodic version check closes the gap.
    resync_interval_s: float = Field(1.0, gt=0, le=60)
    max_xds_streams: int = Field(5000, ge=1, le=100_000)  # per xDS process
    # xDS processes behind the one xDS port (xds_workers.py): 1 = the main process only.
    xds_workers: int = Field(1, ge=1, le=64)
    # TLS on the xDS port (PEM files). With a client CA, clients must present a certificate it
    # signed (the local mesh: sidecars); istiod's configSources TLS (mode SIMPLE) has none.
    xds_tls_cert: Path | None = None
    xds_tls_key: Path | None = None
    xds_tls_client_ca: Path | None = None
    # MCP-over-xDS for istiod (control_plane/mcp.py): full = EnvoyFilters `<ns>/meshcache-<colour>`
    # (exact Wasm config, gRPC cached), basic = TrafficExtensions (no held headers, gRPC bypasses),
    # native = the full mode's EnvoyFilters with the Envoy dynamic module (Istio >= 1.31).
    istio_mode: Literal["full", "basic", "native"] = "full"
    istio_namespace: str = Field("meshcache", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    # Comma-separated colours: one object per colour (pluginConfig.color, selector label `color`);
    # empty: one object for every engine pod.
    istio_color: str = Field("", pattern=r"^[a-z0-9,-]*$")
    istio_wasm_url: str = ""  # e.g. oci://registry/meshcache/filter@sha256:<digest>; empty: nothing served
    # For oci:// the image manifest digest (what Istio verifies), else the module's sha256. Empty:
    # computed from istio_module_path.
    istio_wasm_sha256: str = Field("", pattern=r"^([a-f0-9]{64})?$")
    istio_module_path: Path = FILTER_WASM
    # native mode: the dynamic module's absolute path in the sidecars (render mounts it there).
    istio_native_module: str = Field("", pattern=r"^(/[^\x00]*)?$")
    istio_revision: str = ""  # adds the `istio.io/rev` label (istiod only takes its own revision)
    # How istiod gets those objects (docs/istio.md, "Delivery: MCP or Kubernetes objects"): mcp =
    # served over MCP-over-xDS (istiod's configSources lists this control plane); kube = written to
    # the API server (kube_writer.py: server-side apply into istio_namespace, pruned by label),
    # istiod reads them as any Istio config and does not depend on this process.
    delivery: Literal["mcp", "kube"] = "mcp"
    # kube: the API server from this kubeconfig (its current context), else in-cluster (the pod's
    # ServiceAccount token and CA, KUBERNETES_SERVICE_HOST/PORT).
    kubeconfig: Path | None = None
    kube_timeout_s: float = Field(5.0, gt=0, le=60)  # per API request
    # Re-list and re-apply at least this often (drift: an object deleted or edited by hand, a
    # replica that wrote an older set during a rollout).
    kube_resync_s: float = Field(30.0, ge=1, le=3600)
    kube_write: bool = True  # false in xDS workers (xds_workers.py): one writer per replica
    # The pods whose sidecars cache and their ports (meshcache/contract/extensions.py Workloads):
    # `key=value,...` (empty: meshcache's own engine, app=meshcache-engine), the REST and gRPC
    # container ports (comma-separated; an empty gRPC list: REST only) and the Service ports
    # callers use (the client role's outbound listeners; empty: the container ports).
    istio_selector: str = ""
    istio_http_ports: str = str(HTTP_PORT)
    istio_grpc_ports: str = str(GRPC_PORT)
    istio_service_ports: str = ""
    # Where the status page reads each proxy's cache counters (Prometheus text, control_plane/
    # proxy_stats.py): `node_id=url` entries, and/or a URL template with {ip} for Istio node ids
    # and for the addresses of `proxy_stats_dns` names (headless Services of the cached pods).
    proxy_stats: str = ""
    proxy_stats_template: str = ""
    proxy_stats_dns: str = ""
    proxy_stats_timeout_s: float = Field(1.0, gt=0, le=30)
    # Base URLs of the engines' REST ports (comma-separated): their repository index says which
    # models exist, so a policy prefix matching none gets a warning (control_plane/model_index.py).
    engine_index: str = ""
    engine_index_timeout_s: float = Field(1.0, gt=0, le=30)
    # istiod's debug base URL (its monitoring port, e.g. http://istiod.istio-system:15014/debug):
    # the sidecars it configures and what they ACKed, from its /debug/syncz (control_plane/istiod_sync.py).
    istiod_debug: str = ""
    # The semantic index service (meshcache.semantic, docs/llm.md): the Envoy cluster through which
    # the proxies reach it and the authority (host[:port]) they call it with; both or neither
    # (neither: no `semantic_service` in the filter config, semantic lookups off everywhere).
    semantic_cluster: str = ""
    semantic_authority: str = ""
    semantic_timeout_ms: int = Field(DEFAULT_SEMANTIC_TIMEOUT_MS, ge=1, le=LIMIT_SEMANTIC_TIMEOUT_MS)
    # Where this control plane reaches the service itself to drop a purged policy's index entries
    # (POST /v1/semantic/purge); empty: http://<semantic_authority>. Bounded by the timeout.
    semantic_url: str = Field("", pattern=r"^(https?://[^/?#\s]+/?)?$")
    semantic_purge_timeout_s: float = Field(2.0, gt=0, le=30)

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.xds_tls_cert is None) != (self.xds_tls_key is None):
            raise ValueError("xds_tls_cert and xds_tls_key go together")
        if self.xds_tls_client_ca is not None and self.xds_tls_cert is None:
            raise ValueError("xds_tls_client_ca needs xds_tls_cert and xds_tls_key")
        self.istio_workloads()  # a bad selector or port fails at startup
        if bool(self.semantic_cluster) != bool(self.semantic_authority):
            raise ValueError("semantic_cluster and semantic_authority go together")
        if self.semantic_url and not self.semantic_cluster:
            raise ValueError("semantic_url needs semantic_cluster and semantic_authority")
        self.semantic_service()  # a bad cluster name or authority fails at startup
        return self

    def semantic_service(self) -> SemanticService | None:
        """The filter config's `semantic_service`, or None when not configured."""
        if not self.semantic_cluster:
            return None
        return SemanticService(cluster=self.semantic_cluster, authority=self.semantic_authority,
                               timeout_ms=self.semantic_timeout_ms)

    def semantic_base_url(self) -> str:
        """Where the control plane calls the service (purges); empty when not configured."""
        if not self.semantic_cluster:
            return ""
        return (self.semantic_url or f"http://{self.semantic_authority}").rstrip("/")

    def istio_workloads(self) -> Workloads:
        """The cached pods and ports, from istio_selector and the istio_*_ports."""
        http, grpc = parse_ports(self.istio_http_ports), parse_ports(self.istio_grpc_ports)
        return Workloads(parse_selector(self.istio_selector), http, grpc,
                         parse_ports(self.istio_service_ports) or (*http, *grpc))
