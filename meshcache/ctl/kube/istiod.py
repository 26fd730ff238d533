"""istiod in Kubernetes mode against a LocalCluster: its CA, its injection and validation webhooks,
Istio's cluster objects, and the meshcache control plane as its MCP config source.

The cluster objects are what `istioctl install -f <rendered istio-operator-mcp.yaml>` applies
(`istioctl manifest generate`, istioctl's own CRDs included, then the `default` revision tag as
install sets it: `set_default_tag`), with three local changes:
- no Deployment/HPA/PDB (istiod runs here as a process, as that Deployment's container would:
  its args and plain env, its fieldRefs resolved, its identity the `istiod` ServiceAccount's);
- the `istiod` Service is `type: ExternalName, externalName: localhost`: the API server calls a
  webhook through its Service, and a ClusterIP has nothing behind it here (no kube-proxy); an
  ExternalName resolves to localhost and the API server still checks istiod's certificate for
  `istiod.istio-system.svc`;
- the webhooks' Service port is the free port istiod's webhook server (`--httpsAddr`) listens on.
The mesh config's `xds://` source names the control plane's Service. With `hosts` (the test
node's mesh: the control plane runs as pods) the address stays as rendered, and istiod runs in its
own mount namespace whose /etc/hosts (the host's, plus `hosts`) names that Service's DNS name as the
node address, where the Service's proxy listens (services.py), as cluster DNS would name its
ClusterIP. Without, the address becomes the given host:port. Its `sni`/`subjectAltNames` stay, and
its `credentialName` is a real Secret in istio-system that istiod reads from the API server.

Istio-only Envoy extensions are turned off with istiod's own settings (meshcache.ctl.istiod.server).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from meshcache.ctl import procs
from meshcache.ctl.istiod import server as kubeless
from meshcache.ctl.istiod.binary import require as require_istio

from .cluster import LocalCluster

Obj = dict[str, Any]
NAMESPACE = "istio-system"
SERVICE_ACCOUNT = "istiod"
POD_NAME = "istiod-local"
DROPPED_KINDS = ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget")
WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
# Istio-only Envoy extensions off, as without Kubernetes (the sidecars run upstream Envoy).
ENV_OVERRIDES = {k: kubeless.ENV[k] for k in ("PILOT_ENABLE_METADATA_EXCHANGE", "PILOT_ENABLE_ALPN_FILTER")}
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class KubeIstiodPorts:
    grpc: int  # 15010: plaintext xDS
    secure_grpc: int  # 15012: xDS over TLS and the CA
    http: int  # 8080: /ready, debug
    monitoring: int  # 15014
    webhook: int  # 15017: injection and validation
    ctrlz: int  # 9876

    @classmethod
    def free(cls) -> KubeIstiodPorts:
        return cls(*(procs.free_port() for _ in range(6)))


def localize_operator(operator: Obj, xds_address: str | None, proxy_metadata: dict[str, str] | None = None) -> Obj:
    """The rendered IstioOperator with its control plane source at `xds_address` (host:port), and
    no default metrics provider: the profile's `prometheus` makes istiod add `istio.stats`, an
    istio-proxy-only extension upstream Envoy rejects (as PILOT_ENABLE_METADATA_EXCHANGE)."""
    out = copy.deepcopy(operator)
    out["spec"].setdefault("meshConfig", {})  # absent in a plain `profile: default` operator
    out["spec"]["meshConfig"].setdefault("defaultProviders", {})["metrics"] = []
    if proxy_metadata:  # mesh-wide agent settings (meshConfig.defaultConfig.proxyMetadata)
        default = out["spec"]["meshConfig"].setdefault("defaultConfig", {})
        default["proxyMetadata"] = {**default.get("proxyMetadata", {}), **proxy_metadata}
    for source in out["spec"]["meshConfig"].get("configSources", []):
        if xds_address is not None and source["address"].startswith("xds://"):
            source["address"] = f"xds://{xds_address}"
    return out


def generate(operator: Obj, work: Path) -> list[Obj]:
    """`istioctl manifest generate -f` of the operator (istioctl's built-in charts)."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "istio-operator.yaml"
    path.write_text(yaml.safe_dump(operator, sort_keys=False))
    out = subprocess.run([str(require_istio("istioctl")), "manifest", "generate", "-f", str(path)],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"istioctl manifest generate failed:\n{out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def localize(manifest: list[Obj], webhook_port: int) -> tuple[list[Obj], Obj]:
    """(the objects to apply, istiod's Deployment) from istioctl's manifest (module docstring)."""
    objects: list[Obj] = []
    istiod: Obj | None = None
    for obj in manifest:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind in DROPPED_KINDS:
            if kind == "Deployment" and name == "istiod":
                istiod = obj
            continue
        obj = copy.deepcopy(obj)
        if kind == "Service" and name == "istiod":
            spec = obj["spec"]
            spec.pop("selector", None)
            spec.pop("clusterIP", None)
            spec.update(type="ExternalName", externalName="localhost")
        if kind in WEBHOOK_KINDS:
            for hook in obj.get("webhooks", []):
                service = hook.get("clientConfig", {}).get("service")
                if service and service.get("name") == "istiod":
                    service["port"] = webhook_port
        objects.append(obj)
    if istiod is None:
        raise ValueError("istioctl's manifest has no istiod Deployment")
    return objects, istiod


def process_of(deployment: Obj, kubeconfig: Path, ports: KubeIstiodPorts,
               secure_grpc: str | None = None) -> tuple[list[str], dict[str, str]]:
    """istiod's command line and environment as its Deployment's container has them, with
    local addresses, the kubeconfig, and the fieldRefs resolved."""
    pod = deployment["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "discovery")
    fields = {"metadata.name": POD_NAME, "metadata.namespace": NAMESPACE,
              "spec.serviceAccountName": pod.get("serviceAccountName", SERVICE_ACCOUNT)}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "fieldRef" in (var.get("valueFrom") or {}):
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            if path in fields:
                env[var["name"]] = fields[path]
    env.pop("KUBECONFIG", None)  # a mounted remote-cluster file in the pod; --kubeconfig here
    env |= ENV_OVERRIDES
    # The container's flags first; later flags win (pflag), so ours set the addresses.
    argv = [str(require_istio("pilot-discovery")), *container.get("args", []),
            f"--kubeconfig={kubeconfig}",
            f"--grpcAddr=127.0.0.1:{ports.grpc}", f"--secureGRPCAddr={secure_grpc or f'127.0.0.1:{ports.secure_grpc}'}",
            f"--httpAddr=127.0.0.1:{ports.http}", f"--monitoringAddr=127.0.0.1:{ports.monitoring}",
            f"--httpsAddr=127.0.0.1:{ports.webhook}",
            f"--ctrlz_port={ports.ctrlz}", "--ctrlz_address=127.0.0.1"]
    return argv, env


@dataclass
class KubeIstiod:
    proc: procs.Proc
    ports: KubeIstiodPorts
    work: Path

    def debug(self, path: str, timeout: float = 10.0, **params: str) -> Any:
        r = httpx.get(f"http://127.0.0.1:{self.ports.monitoring}/debug/{path}", params=params, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.proc.stop()


def _webhooks_ready(cluster: LocalCluster, revision_label: str = "default") -> bool:
    """istiod patched its CA into every webhook, and switched the validating ones to Fail (it
    does that once it has seen its own webhook reject an invalid object)."""
    found = 0
    for kind, path in (("MutatingWebhookConfiguration", "mutatingwebhookconfigurations"),
                       ("ValidatingWebhookConfiguration", "validatingwebhookconfigurations")):
        items = (cluster.get(f"/apis/admissionregistration.k8s.io/v1/{path}") or {}).get("items", [])
        for config in items:
            if config["metadata"].get("labels", {}).get("istio.io/rev") != revision_label:
                continue
            for hook in config.get("webhooks", []):
                found += 1
                if not hook["clientConfig"].get("caBundle"):
                    return False
                if kind == "ValidatingWebhookConfiguration" and hook.get("failurePolicy") != "Fail":
                    return False
    return found > 0


def set_default_tag(cluster: LocalCluster, webhook_port: int) -> None:
    """What `istioctl install` does after applying the manifest of a default-revision install:
    the `default` revision tag (`istioctl tag set default`: the injector that serves
    `istio-injection=enabled` and the `istiod-default-validator` webhook for objects without an
    `istio.io/rev` label; the revision's own namespace-wide injectors deactivated), then its
    webhooks pointed at istiod's local port as `localize` does for the manifest's."""
    out = subprocess.run([str(require_istio("istioctl")), "tag", "set", "default", "--revision=default",
                          "--overwrite", "--skip-confirmation", f"--kubeconfig={cluster.kubeconfig}",
                          f"--istioNamespace={NAMESPACE}"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"istioctl tag set default failed:\n{out.stderr.strip()}")
    with cluster.api() as api:
        for path in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            items = api.get(f"/apis/admissionregistration.k8s.io/v1/{path}",
                            params={"labelSelector": "istio.io/tag=default"}).raise_for_status().json()["items"]
            for config in items:
                for hook in config.get("webhooks", []):
                    service = hook.get("clientConfig", {}).get("service")
                    if service and service.get("name") == "istiod":
                        service["port"] = webhook_port
                api.put(f"/apis/admissionregistration.k8s.io/v1/{path}/{config['metadata']['name']}",
                        json=config).raise_for_status()


def apply(cluster: LocalCluster, objects: list[Obj], field_manager: str = "meshcache", force: bool = False) -> None:
    """Server-side apply, CRDs first (established before anything else is applied). `force`: take
    over fields another manager set, as `istioctl install` does (a second install over the
    webhooks `istioctl tag set` changed)."""
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    rest = [o for o in objects if o["kind"] != "CustomResourceDefinition"]
    flags = ("--force-conflicts",) if force else ()
    if crds:
        cluster.kubectl("apply", "--server-side", *flags, f"--field-manager={field_manager}", "-f", "-",
                        input=yaml.safe_dump_all(crds))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                        *(f"crd/{o['metadata']['name']}" for o in crds))
    if rest:
        cluster.kubectl("apply", "--server-side", *flags, f"--field-manager={field_manager}", "-f", "-",
                        input=yaml.safe_dump_all(rest))


POD_FACING_PORT = 15012  # the CA and xDS port injected pods dial (mesh defaultConfig.discoveryAddress)


def start(cluster: LocalCluster, operator: Obj, xds_address: str | None, xds_ca_pem: str | None, work: Path,
          pod_facing_host: str | None = None, proxy_metadata: dict[str, str] | None = None,
          hosts: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S) -> KubeIstiod:
    """Istio's cluster objects applied, then istiod as a supervised child; ready once /ready
    answers (every config source synced, the MCP control plane included) and its webhooks carry
    its CA. `xds_ca_pem`: the CA of the control plane's xDS certificate (the operator's
    `credentialName` Secret; None: that Secret exists already, as the docs' walk-throughs create it).
    `pod_facing_host`: the node address pods reach istiod's CA and xDS
    on (port 15012, as injected pods dial `istiod.istio-system.svc:15012`)."""
    ports = KubeIstiodPorts.free()
    secure_grpc = f"127.0.0.1:{ports.secure_grpc}"
    if pod_facing_host is not None:
        ports = dataclasses.replace(ports, secure_grpc=POD_FACING_PORT)
        secure_grpc = f"{pod_facing_host}:{POD_FACING_PORT}"
    operator = localize_operator(operator, xds_address, proxy_metadata)
    objects, deployment = localize(generate(operator, work), ports.webhook)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    secrets = [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": source["tlsSettings"]["credentialName"], "namespace": NAMESPACE},
                "stringData": {"ca.crt": xds_ca_pem}}
               for source in operator["spec"]["meshConfig"].get("configSources", [])
               if xds_ca_pem is not None and source.get("tlsSettings", {}).get("credentialName")]
    apply(cluster, [namespace, *objects, *secrets], force=True)
    set_default_tag(cluster, ports.webhook)
    kubeconfig = cluster.kubeconfig_for(
        "istiod", f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}",
        ("system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}"))
    argv, env = process_of(deployment, kubeconfig, ports, secure_grpc)
    # istiod writes its DNS certificates under ./var/run/secrets and finds no ./etc/istio files
    # here, so it reads the `istio` and `istio-sidecar-injector` ConfigMaps from the API server.
    run_dir = work / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    if hosts:
        hosts_file = work / "hosts"
        hosts_file.write_text(Path("/etc/hosts").read_text() + "".join(f"{ip} {n}\n" for n, ip in hosts.items()))
        # Its own mount namespace (root): the hosts file over /etc/hosts for istiod only, the rest
        # of the host as it is (unshare execs: istiod keeps the pid).
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts_file), *argv]
    proc = procs.start("istiod", argv, work / "logs", env=env, cwd=run_dir)
    try:
        procs.wait_until(proc, procs.http_ok(f"http://127.0.0.1:{ports.http}/ready"), timeout=timeout,
                         what="ready (/ready: every config source synced)")
        procs.wait_until(proc, lambda: _webhooks_ready(cluster), timeout=timeout,
                         what="serving its webhooks (caBundle patched, validation failurePolicy Fail)")
    except BaseException:
        with contextlib.suppress(Exception):
            proc.stop()
        raise
    return KubeIstiod(proc, ports, work)
