"""A sidecar configured by istiod: a stock Envoy bootstrapped the way istio-agent bootstraps one
(tools/packaging/common/envoy_bootstrap.json), plus the SDS server pilot-agent would be.

The bootstrap holds only what the agent's does: the node (id
`sidecar~IP~POD.NS~NS.svc.cluster.local`, metadata NAMESPACE, ISTIO_VERSION, LABELS, INSTANCE_IPS,
... and the pod's `ISTIO_META_*` proxyMetadata), ADS to istiod (`xds-grpc`; delta xDS, the agent's
default `ISTIO_DELTA_XDS=true`; straight to istiod's plaintext port, where the agent proxies it
over a Unix socket), `sds-grpc` (the SDS server on a Unix socket) and the internal-listener
bootstrap extension. Every listener, cluster, route and the filter config come from istiod.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from meshcache.ctl import launchers, procs
from meshcache.ctl.pki import Identity

from .translate import DOMAIN, Pod

Obj = dict[str, Any]
# The proxy's version as istiod reads it (feature gates compare it with istiod's own): the pinned
# module is 1.31 (scripts/istiod/module-version, its VERSION file).
ISTIO_VERSION = "1.31.0"
CLUSTER_ID = "Kubernetes"  # istiod's default --clusterID


def node_id(pod: Pod) -> str:
    return f"sidecar~{pod.ip}~{pod.name}.{pod.namespace}~{pod.namespace}.svc.{DOMAIN}"


def node_metadata(pod: Pod, proxy_metadata: dict[str, str] | None = None) -> Obj:
    """What istio-agent puts in the node: the ISTIO_META_* proxyMetadata become keys of their own."""
    meta: Obj = {
        "NAMESPACE": pod.namespace,
        "NAME": pod.name,
        "ISTIO_VERSION": ISTIO_VERSION,
        "LABELS": pod.all_labels,
        "INSTANCE_IPS": pod.ip,
        "CLUSTER_ID": CLUSTER_ID,
        "MESH_ID": DOMAIN,
        "WORKLOAD_NAME": pod.labels.get("app", pod.name),
        "SERVICE_ACCOUNT": pod.service_account,
        "INTERCEPTION_MODE": "REDIRECT",
        "POD_PORTS": json.dumps([{"name": n, "containerPort": p, "protocol": "TCP"}
                                 for n, p in sorted(pod.container_ports.items())]),
    }
    for key, value in (proxy_metadata or {}).items():
        if key.startswith("ISTIO_META_"):
            meta[key.removeprefix("ISTIO_META_")] = value
    return meta


def proxy_metadata_of(workload: Obj) -> dict[str, str]:
    """`proxyMetadata` of a rendered Deployment's `proxy.istio.io/config` annotation."""
    ann = workload["spec"]["template"]["metadata"].get("annotations", {})
    config = yaml.safe_load(ann.get("proxy.istio.io/config", "")) or {}
    return {str(k): str(v) for k, v in (config.get("proxyMetadata") or {}).items()}


def _static_cluster(name: str, address: Obj) -> Obj:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name,
                            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_connections": 100000,
                                             "max_pending_requests": 100000, "max_requests": 100000}]},
    }


def bootstrap(pod: Pod, *, istiod_port: int, sds_socket: Path, admin_port: int,
              proxy_metadata: dict[str, str] | None = None) -> Obj:
    ads = {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"}
    return {
        "node": {"id": node_id(pod), "cluster": f"{pod.labels.get('app', pod.name)}.{pod.namespace}",
                 "metadata": node_metadata(pod, proxy_metadata)},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "dynamic_resources": {
            "lds_config": ads,
            "cds_config": ads,
            "ads_config": {"api_type": "DELTA_GRPC", "transport_api_version": "V3",
                           "set_node_on_first_message_only": True,
                           "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]},
        },
        "static_resources": {"clusters": [
            _static_cluster("xds-grpc", {"socket_address": {"address": "127.0.0.1", "port_value": istiod_port}}),
            _static_cluster("sds-grpc", {"pipe": {"path": str(sds_socket)}}),
        ]},
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"}}],
    }


@dataclass
class Sidecar:
    """A running sidecar (Envoy + its SDS server) of one pod."""

    pod: Pod
    envoy: procs.Proc
    sds: procs.Proc
    admin_port: int
    config_path: Path
    sds_argv: list[str]
    log_dir: Path
    envoy_version: str = "1.40"  # paths.ENVOYS: 1.39 is istio-proxy 1.31's Envoy (the native host's mesh)

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def config_dump(self, resource: str = "") -> Obj:
        params = {"resource": resource} if resource else {}
        r = httpx.get(f"{self.admin}/config_dump", params={**params, "include_eds": "true"}, timeout=10)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def stats(self, prefix: str = "") -> dict[str, int]:
        from meshcache.ctl.launchers import envoy_stats

        return envoy_stats(self.admin_port, prefix)

    def restart_envoy(self) -> None:
        self.envoy.stop()
        self.envoy = _start_envoy(self.pod, self.config_path, self.admin_port, self.log_dir, self.envoy_version)

    def start_sds(self) -> procs.Proc:
        return _start_sds(self.pod, self.sds_argv, self.log_dir)

    def stop(self) -> None:
        self.envoy.stop()
        self.sds.stop()


def _start_envoy(pod: Pod, config_path: Path, admin_port: int, log_dir: Path, envoy: str = "1.40") -> procs.Proc:
    # LIVE = the initial LDS/CDS from istiod arrived and every listener warmed (certificates from SDS).
    return launchers.start_envoy(config_path, admin_port, log_dir, name=f"sidecar-{pod.name}", log_level="warning",
                                 # misc:error as istio-agent's default proxyComponentLogLevel: istiod's
                                 # configs use fields Envoy warns are deprecated (max_grpc_timeout,
                                 # match_subject_alt_names), ~15 lines a start otherwise.
                                 extra_args=["--drain-time-s", "1", "--component-log-level", "misc:error"],
                                 timeout=60, what="LIVE (config from istiod)", envoy=envoy)


def _start_sds(pod: Pod, argv: list[str], log_dir: Path) -> procs.Proc:
    socket = Path(argv[argv.index("--socket") + 1])
    socket.unlink(missing_ok=True)  # a restart waits for the new server's socket
    return procs.start_ready(f"sds-{pod.name}", argv, log_dir, [(socket.exists, 30, "serving SDS")])


def start_sidecar(pod: Pod, identity: Identity, *, istiod_port: int, work_dir: Path, log_dir: Path,
                  socket: Path, proxy_metadata: dict[str, str] | None = None,
                  admin_port: int | None = None, envoy: str = "1.40") -> Sidecar:
    """`socket`: the SDS server's Unix socket (a short path: at most 107 bytes). `envoy`: which
    Envoy (paths.ENVOYS) plays istio-proxy."""
    admin_port = admin_port or procs.free_port()
    work_dir.mkdir(parents=True, exist_ok=True)
    sds_argv = [sys.executable, "-m", "meshcache.ctl.istiod.sds", "--socket", str(socket),
                "--cert", str(identity.cert), "--key", str(identity.key), "--ca", str(identity.ca)]
    sds = _start_sds(pod, sds_argv, log_dir)
    config = bootstrap(pod, istiod_port=istiod_port, sds_socket=socket, admin_port=admin_port,
                       proxy_metadata=proxy_metadata)
    config_path = work_dir / "envoy.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        proc = _start_envoy(pod, config_path, admin_port, log_dir, envoy)
    except BaseException:
        sds.stop()
        raise
    return Sidecar(pod, proc, sds, admin_port, config_path, sds_argv, log_dir, envoy)
