"""Start a real istiod (pilot-discovery) without Kubernetes, and read its debug endpoints.

No kube client (`--registries=` empty, no kubeconfig); config from `meshConfig.configSources`
only (translate.mesh_config: `fs://` with the translated istio/ objects, `xds://` = the meshcache
control plane over TLS). Every port on loopback, picked free. What is turned off, and why:

- `PILOT_ENABLE_METADATA_EXCHANGE=false`, `PILOT_ENABLE_ALPN_FILTER=false`: istiod would put
  `istio.metadata_exchange`, `io.istio.http.peer_metadata` and `istio.alpn` into the generated
  config; only istio-proxy has them and a stock Envoy rejects the listener.
- `ENABLE_CA_SERVER=false` and no `--secureGRPCAddr`: the sidecars' certificates come from the
  mesh CA over our SDS server (sds.py), as pilot-agent would serve them; istiod needs no CA.
- `--httpsAddr=` empty: no webhook server (injection and validation need Kubernetes).

Ready = the plaintext gRPC port accepts connections: istiod opens it only after every config
source synced (its `/ready` stays 503 without Kubernetes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from meshcache.ctl import procs

from .binary import require

NAMESPACE = "istio-system"  # istiod's own namespace (root namespace for mesh-wide config)
POD_NAME = "istiod-local"
# Istio-only Envoy extensions off, no CA, no webhooks (module docstring).
ENV = {
    "PILOT_ENABLE_METADATA_EXCHANGE": "false",
    "PILOT_ENABLE_ALPN_FILTER": "false",
    "ENABLE_CA_SERVER": "false",
    "POD_NAMESPACE": NAMESPACE,
    "POD_NAME": POD_NAME,
}


@dataclass(frozen=True)
class IstiodPorts:
    grpc: int  # 15010 in a cluster: plaintext xDS for the sidecars
    http: int  # 8080: /ready, debug
    monitoring: int  # 15014: /metrics, /debug/syncz, /debug/config_dump
    ctrlz: int  # 9876: ControlZ (localhost only)

    @classmethod
    def free(cls) -> IstiodPorts:
        return cls(procs.free_port(), procs.free_port(), procs.free_port(), procs.free_port())


@dataclass
class Istiod:
    proc: procs.Proc
    ports: IstiodPorts
    mesh_config: Path
    log_dir: Path
    name: str = "istiod"

    @property
    def debug_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.monitoring}/debug"

    def debug(self, path: str, timeout: float = 10.0, **params: str) -> Any:
        r = httpx.get(f"http://127.0.0.1:{self.ports.monitoring}/debug/{path}", params=params, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def syncz(self) -> list[dict[str, Any]]:
        """Per connected proxy: its id and, per xDS type, ACKed/NACKed/STALE (istiod's own view)."""
        return self.debug("syncz") or []  # type: ignore[no-any-return]

    def config_dump(self, proxy_id: str) -> dict[str, Any]:
        """What istiod generates for a connected proxy (`POD.NAMESPACE`), as Envoy's config_dump."""
        return self.debug("config_dump", proxyID=proxy_id)  # type: ignore[no-any-return]

    def configz(self) -> list[dict[str, Any]]:
        """Every config object istiod holds (all sources)."""
        return self.debug("configz") or []  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.stop()


def argv(mesh_config: Path, ports: IstiodPorts) -> list[str]:
    return [
        str(require("pilot-discovery")), "discovery",
        "--registries=",  # no Kubernetes service registry: ServiceEntries/WorkloadEntries only
        f"--meshConfig={mesh_config}",
        f"--grpcAddr=127.0.0.1:{ports.grpc}",
        f"--httpAddr=127.0.0.1:{ports.http}",
        f"--monitoringAddr=127.0.0.1:{ports.monitoring}",
        "--secureGRPCAddr=",
        "--httpsAddr=",
        f"--ctrlz_port={ports.ctrlz}",
        "--ctrlz_address=127.0.0.1",
        f"--namespace={NAMESPACE}",
        "--log_output_level=default:info",
    ]


def _launch(name: str, mesh_config: Path, ports: IstiodPorts, log_dir: Path, timeout: float = 60.0) -> procs.Proc:
    return procs.start_ready(name, argv(mesh_config, ports), log_dir,
                             [(procs.tcp_open(ports.grpc), timeout, "serving xDS (every config source synced)")],
                             env=ENV)


def write_mesh_config(mesh: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(mesh, sort_keys=False))
    return path


def start_istiod(mesh_config: Path, log_dir: Path, ports: IstiodPorts | None = None,
                 name: str = "istiod") -> Istiod:
    """istiod as a supervised child, ready once its xDS port accepts (all sources synced)."""
    ports = ports or IstiodPorts.free()
    return Istiod(_launch(name, mesh_config, ports, log_dir), ports, mesh_config, log_dir, name)
