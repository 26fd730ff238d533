"""The test kubelet (meshcache.ctl.kube.kubelet): an injected engine pod scheduled to its node
gets a network namespace with an address from the node's pod CIDR, Istio's own traffic capture
(`istio-init`: pilot-agent istio-iptables), and a running `istio-proxy` (pilot-agent driving
upstream Envoy) whose workload certificate comes from istiod's CA for the pod's ServiceAccount;
then the engine's own init container and container run, the pod turns Ready through the agent's
probe rewrite, its Service gets the pod IPs as endpoints, and STRICT mTLS holds at the sidecar."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509

from meshcache.contract import oci
from meshcache.contract.extensions import AFFINITY_LABEL
from meshcache.ctl.istio import render
from meshcache.ctl.kube.mesh import KubeMesh
from tests.helpers.kserve import MODEL_INFER, mlp_json, mlp_request
from tests.helpers.wait import eventually
from tests.kube.mesh.helpers import (
    caller_pod,
    ecds_filters,
    engine_calls,
    engine_pods,
    grpc_call,
    http_call,
    http_ok,
    proxy_status,
    ready_engine_pods,
    ready_sidecars,
    running,
    service_ip,
)

Obj = dict[str, Any]
NS = render.BASE_NAMESPACE


def test_engine_pods_get_pod_cidr_addresses_capture_and_a_ready_sidecar(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.network is not None and kube_mesh.kubelet is not None

    def ready() -> list[Obj]:
        pods = engine_pods(kube_mesh)
        ok = pods and all((proxy_status(p) or {}).get("ready") for p in pods)
        assert ok, (kube_mesh.kubelet.errors[-3:], [p["status"] for p in pods])  # type: ignore[union-attr]
        return pods

    pods = eventually(ready, timeout=120, interval=0.5)
    cidr = ipaddress.ip_network(kube_mesh.network.cidr)
    for pod in pods:
        ip = pod["status"]["podIP"]
        assert ipaddress.ip_address(ip) in cidr and pod["status"]["hostIP"] == kube_mesh.network.node_ip
        init = next(c for c in pod["status"]["initContainerStatuses"] if c["name"] == "istio-init")
        assert init["state"]["terminated"]["exitCode"] == 0
        running = kube_mesh.kubelet.pods[f"{NS}/{pod['metadata']['name']}"]
        rules = subprocess.run(running.net.exec_argv("iptables-save", "-t", "nat"), capture_output=True,
                               text=True, check=True).stdout
        assert "-A ISTIO_INBOUND" in rules and "--to-ports 15006" in rules and "--to-ports 15001" in rules
        assert "--uid-owner 1337" in rules


def test_the_sidecar_certificate_comes_from_istiods_ca(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.cluster is not None and kube_mesh.kubelet is not None
    pods = eventually(lambda: ready_sidecars(kube_mesh), timeout=120)
    pod = pods[0]
    running = kube_mesh.kubelet.pods[f"{NS}/{pod['metadata']['name']}"]
    certs = eventually(lambda: _workload_certs(running), timeout=30)
    uris = {san.get("uri") for c in certs for cert in c["cert_chain"] for san in cert.get("subject_alt_names", [])}
    assert "spiffe://cluster.local/ns/meshcache/sa/meshcache-engine" in uris
    # Signed by istiod's own CA (its self-signed root, published to the namespace as istio-ca-root-cert).
    root_map = kube_mesh.cluster.get(f"/api/v1/namespaces/{NS}/configmaps/istio-ca-root-cert")
    assert root_map is not None
    root = x509.load_pem_x509_certificate(root_map["data"]["root-cert.pem"].encode())
    roots = {ca["serial_number"].lstrip("0").lower() for c in certs for ca in c.get("ca_cert", [])}
    assert format(root.serial_number, "x") in roots, (roots, format(root.serial_number, "x"))


def _workload_certs(running: Any) -> list[Obj]:
    """Envoy's certificates (admin /certs) read from inside the pod's namespace (admin is on its loopback)."""
    script = "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:15000/certs').read().decode())"
    out = subprocess.run(running.net.exec_argv(sys.executable, "-c", script), capture_output=True, text=True,
                         check=True).stdout
    return [c for c in json.loads(out)["certificates"] if c.get("cert_chain")]


def test_the_agent_rotates_the_workload_certificate_before_it_expires(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.kubelet is not None
    pod = ready_engine_pods(kube_mesh)[0]
    running = kube_mesh.kubelet.pods[f"{NS}/{pod['metadata']['name']}"]

    def serials() -> set[str]:
        return {cert["serial_number"] for c in _workload_certs(running) for cert in c["cert_chain"]}

    ttl_s = int(kube_mesh.config.workload_cert_ttl.removesuffix("s"))  # short: tests/kube/conftest.py
    first = eventually(serials, timeout=30)
    # A new certificate from istiod's CA for the same identity, on the agent's own schedule.
    rotated = eventually(lambda: serials() - first, timeout=ttl_s * 1.5, interval=1.0)
    certs = _workload_certs(running)
    assert rotated and all(int(cert["days_until_expiration"]) == 0 for c in certs for cert in c["cert_chain"])
    uris = {san.get("uri") for c in certs for cert in c["cert_chain"] for san in cert.get("subject_alt_names", [])}
    assert "spiffe://cluster.local/ns/meshcache/sa/meshcache-engine" in uris


def test_istiod_sees_the_sidecars_and_they_ack_its_config(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.istiod is not None
    pods = eventually(lambda: ready_sidecars(kube_mesh), timeout=120)
    wanted = {f"{p['metadata']['name']}.{NS}" for p in pods}

    def acked() -> bool:
        sync = {s["proxy"]: s for s in kube_mesh.istiod.debug("syncz") or []}  # type: ignore[union-attr]
        assert wanted <= set(sync), sorted(sync)
        for proxy in wanted:
            for kind in ("cluster", "listener", "route"):
                assert sync[proxy][f"{kind}_acked"] == sync[proxy][f"{kind}_sent"], (proxy, kind, sync[proxy])
        return True

    eventually(acked, timeout=60)


def test_engine_pods_turn_ready_through_the_agents_probe_rewrite_and_become_endpoints(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.cluster is not None
    pods = ready_engine_pods(kube_mesh)
    for pod in pods:
        engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        # The injector rewrote the engine's probe to the agent (port 15020), which probes the app.
        assert engine["readinessProbe"]["httpGet"]["port"] == 15020
        assert engine["readinessProbe"]["httpGet"]["path"].startswith("/app-health/engine/")
        states = {c["name"]: c for c in pod["status"]["initContainerStatuses"] + pod["status"]["containerStatuses"]}
        assert states["demo-models"]["state"]["terminated"]["exitCode"] == 0 and states["engine"]["ready"]

    def endpoints() -> set[str]:
        slices = kube_mesh.cluster.get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"  # type: ignore[union-attr]
                                  f"?labelSelector=kubernetes.io%2Fservice-name%3D{render.ENGINE_APP}")
        return {a for s in (slices or {}).get("items", []) for e in s.get("endpoints") or []
                if e.get("conditions", {}).get("ready") for a in e["addresses"]}

    want = {p["status"]["podIP"] for p in pods}
    eventually(lambda: endpoints() == want, timeout=30)


def test_strict_mtls_holds_at_the_captured_port(kube_mesh: KubeMesh) -> None:
    pod = ready_engine_pods(kube_mesh)[0]
    running = kube_mesh.kubelet.pods[f"{NS}/{pod['metadata']['name']}"]  # type: ignore[union-attr]
    # Inside the pod, on loopback (not captured), the engine answers.
    script = "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready').status)"
    inside = subprocess.run(running.net.exec_argv(sys.executable, "-c", script), capture_output=True, text=True,
                            check=True).stdout.strip()
    assert inside == "200"
    # From the node, plaintext to the same port is captured (istio-iptables redirects it to the
    # sidecar's 15006) and refused there: PeerAuthentication STRICT. The connection is accepted
    # (not ConnectError: something listens) and the redirect rule counts it.
    before = _redirected(running.net.exec_argv)
    with pytest.raises(httpx.HTTPError) as refused:
        httpx.get(f"http://{running.net.ip}:8000/v2/health/ready", timeout=5).raise_for_status()
    assert not isinstance(refused.value, httpx.ConnectError), refused.value
    assert _redirected(running.net.exec_argv) > before


def _redirected(exec_argv: Any) -> int:
    """Packets istio-iptables' inbound redirect (to 15006) has matched in the pod's namespace."""
    out = subprocess.run(exec_argv("iptables", "-t", "nat", "-L", "ISTIO_IN_REDIRECT", "-v", "-n", "-x"),
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines()[2:] if "15006" in line)


def test_a_client_pod_reaches_the_engine_service_through_both_sidecars_and_an_outsider_is_denied(
        kube_mesh: KubeMesh) -> None:
    ready_engine_pods(kube_mesh)
    ip = service_ip(kube_mesh)  # no kube-proxy: only capture routes it
    # Cache affinity (two engine replicas): the client's sidecar keys the route on the request.
    client = caller_pod(kube_mesh, "caller", "meshcache-client", {AFFINITY_LABEL: "true"})

    def answered() -> Obj:
        result = http_call(client, "/v2/health/ready", render.ENGINE_APP, ip)
        assert result["status"] == 200, result  # 503 until the client's sidecar has the engine endpoints
        return result

    assert eventually(answered, timeout=30)["headers"]["server"] == "envoy"
    # Not a principal the engine's AuthorizationPolicy admits: the engine's sidecar refuses it.
    outsider = caller_pod(kube_mesh, "outsider", "someone-else")
    denied = http_call(outsider, "/v2/health/ready", render.ENGINE_APP, ip)
    assert denied["status"] == 403 and "RBAC: access denied" in denied["body"]


def test_the_filter_comes_over_oci_through_istio_agent_and_the_second_rest_infer_is_a_hit(
        kube_mesh: KubeMesh, filter_wasm: Path) -> None:
    """The rendered EnvoyFilter (from the control plane over MCP, through istiod) names the module
    as oci://registry.example.com/...@sha256:<digest>: istio-agent fetched it from the node's
    registry, checked the digest and handed Envoy the local file; the filter then caches: the
    second identical request is answered by the engine's sidecar, byte-identical, the engine
    called once in the whole mesh."""
    pods = ready_engine_pods(kube_mesh)

    def wasm_loaded() -> Obj:
        config = ecds_filters(running(kube_mesh, pods[0])).get("meshcache", {}).get("typed_config", {})
        # Until the agent has the module it serves Istio's fail-open stand-in (an allow-all RBAC filter).
        assert config.get("@type", "").endswith("wasm.v3.Wasm"), config
        return config

    code = eventually(wasm_loaded, timeout=90, interval=0.5)["config"]["vm_config"]["code"]["local"]["filename"]
    # The agent's cache names the module by the digest it pulled and checked: the one render pinned.
    assert code.startswith("/var/lib/istio/data/") and code.endswith(f"/{oci.image_for(filter_wasm).digest}.wasm")

    ip = service_ip(kube_mesh)
    client = caller_pod(kube_mesh, "hit-caller", "meshcache-client", {AFFINITY_LABEL: "true"})
    path, body = "/v2/models/mlp-classifier/infer", json.dumps(mlp_json(seed=3401))

    post = partial(http_ok, client, path, ip, body)

    before = sum(engine_calls(kube_mesh, "mlp-classifier", pods).values())
    first = eventually(post, timeout=30)
    assert first["headers"]["cache-status"] == "meshcache; fwd=miss; stored", first["headers"]
    second = post()
    assert second["headers"]["cache-status"].startswith("meshcache; hit; ttl="), second["headers"]
    assert second["body"] == first["body"]
    assert sum(engine_calls(kube_mesh, "mlp-classifier", pods).values()) == before + 1


def test_the_second_grpc_model_infer_from_a_client_pod_is_a_hit(kube_mesh: KubeMesh) -> None:
    """A single-pass hit: the engine's sidecar answers the repeat itself (byte-identical protobuf),
    the engine called once in the whole mesh."""
    pods = ready_engine_pods(kube_mesh)
    ip = service_ip(kube_mesh)
    client = caller_pod(kube_mesh, "grpc-caller", "meshcache-client", {AFFINITY_LABEL: "true"})
    request = mlp_request(seed=3402).SerializeToString()

    def infer() -> Obj:
        result = grpc_call(client, MODEL_INFER, request, render.ENGINE_APP, ip)
        assert result["code"] == "OK", result  # UNAVAILABLE until the client sidecar has endpoints
        return result

    before = sum(engine_calls(kube_mesh, "mlp-classifier", pods).values())
    first = eventually(infer, timeout=30)
    assert first["cache_status"] == "meshcache; fwd=miss; stored", first
    second = infer()
    assert second["cache_status"].startswith("meshcache; hit; ttl="), second
    assert second["response"] == first["response"] and first["response"]
    assert sum(engine_calls(kube_mesh, "mlp-classifier", pods).values()) == before + 1
