"""Policies through istiod to agent-driven sidecars: a PUT to the control plane reaches the engine
pods' sidecars as ECDS (istiod's ACK in its syncz, the version in each sidecar's config dump);
`istioctl proxy-status` against the cluster (istiod's xDS debug on its TLS port 15012, a token
from the kubeconfig, as for an out-of-cluster control plane) and `istioctl proxy-config` show the
meshcache filter; a purge empties the cached entries (the next identical request is a MISS)."""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

from meshcache.contract.extensions import AFFINITY_LABEL
from meshcache.ctl.istiod.binary import require
from meshcache.ctl.istiod.status import ECDS_TYPE_URL
from meshcache.ctl.kube.mesh import KubeMesh
from meshcache.ctl.kube.up import wait_applied
from tests.helpers.kserve import mlp_json
from tests.helpers.wait import eventually
from tests.kube.mesh.helpers import (
    CACHE_CALLER,
    NS,
    caller_pod,
    ecds_filters,
    engine_calls,
    envoy_admin,
    http_ok,
    ready_engine_pods,
    running,
    service_ip,
)

Obj = dict[str, Any]
ISTIOD_SAN = "istiod.istio-system.svc"  # istiod's serving certificate (its DNS name, no IP SANs)


def _istioctl(mesh: KubeMesh, *args: str) -> str:
    """istioctl against the cluster. istiod's debug over xDS needs an authenticated caller, so
    `proxy-status` dials its TLS port (15012 on the node address, as pods do) with a token it
    asks the API server for; port-forward is not there (the test kubelet serves no streaming)."""
    assert mesh.cluster is not None
    out = subprocess.run([str(require("istioctl")), *args, f"--kubeconfig={mesh.cluster.kubeconfig}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (args, out.stderr[-1500:])
    return out.stdout


def _xds(mesh: KubeMesh) -> tuple[str, ...]:
    assert mesh.network is not None
    return (f"--xds-address={mesh.network.node_ip}:15012", f"--authority={ISTIOD_SAN}")


def _engine_netns(mesh: KubeMesh, pods: list[Obj]) -> dict[str, str]:
    return {f"{p['metadata']['name']}.{NS}": running(mesh, p).net.name for p in pods}


def _ecds_status(mesh: KubeMesh) -> dict[str, Obj]:
    """`istioctl proxy-status -o json`: each proxy's ECDS sync state as istiod reports it (proxies
    without an ECDS filter, such as a caller without the client role, subscribe to none)."""
    out = json.loads(_istioctl(mesh, "proxy-status", *_xds(mesh), "-o", "json"))
    return {r["node"]["id"]: c for r in out["resources"] for c in r["genericXdsConfigs"]
            if c["typeUrl"] == ECDS_TYPE_URL}


def test_a_policy_put_reaches_the_sidecars_through_istiod_and_istioctl_shows_the_filter(
        kube_mesh: KubeMesh, tmp_path: Path) -> None:
    assert kube_mesh.istiod is not None
    pods = ready_engine_pods(kube_mesh)
    proxies = _engine_netns(kube_mesh, pods)
    debug = f"http://127.0.0.1:{kube_mesh.istiod.ports.monitoring}/debug"
    before = _ecds_status(kube_mesh)
    assert set(proxies) <= set(before), sorted(before)
    prefix = "kube-policy-put"  # this test's own prefix, deleted at the end
    with kube_mesh.api() as api:
        version = int(api.put(f"/v1/policies/{prefix}", json={"ttl_s": 77}).raise_for_status().json()["version"])
    try:
        # Every engine sidecar runs the new version (its config dump, read inside its pod) and
        # istiod has its ACK (syncz: ECDS acked == sent, no error).
        wait_applied(debug, proxies, version, timeout=60)

        def synced() -> dict[str, Obj]:
            now = _ecds_status(kube_mesh)
            for proxy in proxies:
                assert now[proxy]["configStatus"] == "SYNCED", now[proxy]
                assert now[proxy]["lastUpdated"] != before[proxy]["lastUpdated"], (now[proxy], before[proxy])
            return now

        eventually(synced, timeout=30, interval=1.0)
        # istioctl proxy-config of a sidecar's own config dump (read inside its pod): the meshcache
        # Wasm filter, configured with the new policy; proxy-status diffs that dump against istiod.
        pod = pods[0]
        dump = tmp_path / "config_dump.json"
        dump.write_text(envoy_admin(running(kube_mesh, pod), "/config_dump"))
        ecds = json.loads(_istioctl(kube_mesh, "proxy-config", "ecds", "--file", str(dump), "-o", "json"))
        meshcache = next(e["ecdsFilter"] for e in ecds["ecdsFilters"] if e["ecdsFilter"]["name"] == "meshcache")
        assert meshcache["typedConfig"]["@type"].endswith("wasm.v3.Wasm"), meshcache
        plugin = json.loads(meshcache["typedConfig"]["config"]["configuration"]["value"])
        assert int(plugin["version"]) >= version
        assert any(p.get("model_prefix") == prefix and p.get("ttl_s") == 77 for p in plugin["policies"]), plugin
        diff = _istioctl(kube_mesh, "proxy-status", *_xds(kube_mesh), f"{pod['metadata']['name']}.{NS}",
                         "--file", str(dump))
        assert "Listeners Match" in diff and "Clusters Match" in diff, diff
    finally:
        with kube_mesh.api() as api:
            gone = int(api.delete(f"/v1/policies/{prefix}").raise_for_status().json()["version"])
        wait_applied(debug, proxies, gone, timeout=60)


def test_a_purge_through_istiod_empties_the_cached_entries(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.istiod is not None
    pods = ready_engine_pods(kube_mesh)
    ip = service_ip(kube_mesh)
    client = caller_pod(kube_mesh, CACHE_CALLER, "meshcache-client", {AFFINITY_LABEL: "true"})
    path, body = "/v2/models/mlp-classifier/infer", json.dumps(mlp_json(seed=3403))

    post = partial(http_ok, client, path, ip, body)

    eventually(post, timeout=30)
    assert post()["headers"]["cache-status"].startswith("meshcache; hit; ttl=")
    calls = sum(engine_calls(kube_mesh, "mlp-classifier", pods).values())
    with kube_mesh.api() as api:
        version = int(api.post("/v1/purge", json={"model_prefix": "mlp-classifier"}).raise_for_status()
                      .json()["version"])
    wait_applied(f"http://127.0.0.1:{kube_mesh.istiod.ports.monitoring}/debug", _engine_netns(kube_mesh, pods),
                 version, timeout=60)
    again = post()
    assert again["headers"]["cache-status"] == "meshcache; fwd=miss; stored", again["headers"]
    assert sum(engine_calls(kube_mesh, "mlp-classifier", pods).values()) == calls + 1
    assert post()["headers"]["cache-status"].startswith("meshcache; hit; ttl=")
    # Every sidecar kept its filter: a purge is a policy version, not a new module.
    for pod in pods:
        assert ecds_filters(running(kube_mesh, pod))["meshcache"]["typed_config"]["@type"].endswith("wasm.v3.Wasm")
