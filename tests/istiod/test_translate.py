"""The rendered istio/ objects as istiod reads them without Kubernetes (no processes: the
translation only; tests/istiod/test_istiod.py runs it against istiod)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshcache.ctl.istio import render
from meshcache.ctl.istiod import translate

Obj = dict


@pytest.fixture(scope="module")
def rendered(filter_wasm: Path) -> tuple[list[Obj], Obj]:
    opts = render.RenderOptions(color="green", also_colors=("blue",), module_path=filter_wasm)
    return render.render(opts), render.render_operators(opts)[1]


def engine_pod(objects: list[Obj], ip: str = "127.9.9.1") -> translate.Pod:
    dep = next(o for o in objects
               if o["kind"] == "Deployment" and o["metadata"]["labels"].get("app") == "meshcache-engine")
    return translate.pod_from_template(dep, "engine-1", ip, app_ports={8000: 18000, 8001: 18001})


def test_services_become_service_entries_and_pods_workload_entries(rendered: tuple[list[Obj], Obj]) -> None:
    objects, _ = rendered
    pod = engine_pod(objects)
    client = translate.Pod("client-1", "meshcache", "127.9.9.2", {"app": "meshcache-client"}, "meshcache-client",
                           {}, caller=True)
    out = translate.translate(objects, [pod, client])
    by_kind: dict[str, list[Obj]] = {}
    for o in out:
        by_kind.setdefault(o["kind"], []).append(o)
    [se] = by_kind["ServiceEntry"]  # only the engine Service selects a placed pod
    assert se["spec"]["hosts"] == ["meshcache-engine.meshcache.svc.cluster.local"]
    assert se["spec"]["workloadSelector"] == {"labels": {"app": "meshcache-engine"}}
    assert [(p["number"], p["protocol"], p["targetPort"]) for p in se["spec"]["ports"]] == [
        (8000, "HTTP", 8000), (8001, "GRPC", 8001)]
    wes = {w["metadata"]["name"]: w["spec"] for w in by_kind["WorkloadEntry"]}
    assert wes["engine-1"]["address"] == "127.9.9.1" and wes["engine-1"]["serviceAccount"] == "meshcache-engine"
    assert wes["engine-1"]["labels"]["color"] == "green"
    assert wes["engine-1"]["labels"][translate.LOCAL_POD_LABEL] == "engine-1"
    sidecars = {s["metadata"]["name"]: s["spec"] for s in by_kind["Sidecar"]}
    assert [(i["port"]["number"], i["bind"], i["captureMode"], i["defaultEndpoint"])
            for i in sidecars["engine-1"]["ingress"]] == [(8000, "127.9.9.1", "NONE", "127.0.0.1:18000"),
                                                          (8001, "127.9.9.1", "NONE", "127.0.0.1:18001")]
    assert "egress" not in sidecars["engine-1"]
    assert sidecars["client-1"]["egress"] == [{"bind": "127.9.9.2", "captureMode": "NONE", "hosts": ["*/*"]}]
    # The Istio objects as rendered; nothing Kubernetes-only; no EnvoyFilter (that comes over MCP).
    for kind in ("PeerAuthentication", "AuthorizationPolicy", "DestinationRule", "VirtualService", "Gateway"):
        assert [o for o in out if o["kind"] == kind] == [o for o in objects if o["kind"] == kind]
    assert not {"Namespace", "Deployment", "Service", "NetworkPolicy", "EnvoyFilter"} & set(by_kind)


def test_a_served_container_port_outside_the_service_gets_an_ingress_listener(rendered: tuple[list[Obj], Obj]) -> None:
    """The engine's metrics port (in no Service): bound like the Service ports when the pod serves
    it, so the AuthorizationPolicy applies there as behind iptables; not bound when it does not."""
    objects, _ = rendered
    pod = engine_pod(objects)
    served = translate.Pod(pod.name, pod.namespace, pod.ip, pod.labels, pod.service_account, pod.container_ports,
                           app_ports={**pod.app_ports, 8002: 18002})
    by_name = {o["metadata"]["name"]: o for o in translate.translate(objects, [served]) if o["kind"] == "Sidecar"}
    assert [(i["port"]["number"], i["port"]["protocol"], i["defaultEndpoint"])
            for i in by_name["engine-1"]["spec"]["ingress"]] == [
        (8000, "HTTP", "127.0.0.1:18000"), (8001, "GRPC", "127.0.0.1:18001"), (8002, "TCP", "127.0.0.1:18002")]


def test_a_pod_without_its_app_port_is_an_error(rendered: tuple[list[Obj], Obj]) -> None:
    objects, _ = rendered
    pod = engine_pod(objects)
    broken = translate.Pod(pod.name, pod.namespace, pod.ip, pod.labels, pod.service_account, pod.container_ports,
                           app_ports={8000: 18000})
    with pytest.raises(ValueError, match="no app port for container port 8001"):
        translate.translate(objects, [broken])


def test_mesh_config_is_the_operators_with_local_addresses(rendered: tuple[list[Obj], Obj]) -> None:
    _, operator = rendered
    mesh = translate.mesh_config(operator, Path("/tmp/fs"), 4321, "-----BEGIN CERTIFICATE-----\n")
    fs, xds = mesh["configSources"]
    assert fs == {"address": "fs:///tmp/fs"}
    assert xds["address"] == "xds://127.0.0.1:4321"
    tls = xds["tlsSettings"]
    assert tls["mode"] == "SIMPLE" and "credentialName" not in tls
    assert tls["caCertificates"].startswith("-----BEGIN CERTIFICATE-----")
    original = operator["spec"]["meshConfig"]["configSources"][1]["tlsSettings"]
    assert tls["sni"] == original["sni"] and tls["subjectAltNames"] == original["subjectAltNames"]
    assert mesh.get("meshMTLS") == operator["spec"]["meshConfig"].get("meshMTLS")  # set only with --mesh-tls13
    assert "credentialName" in original, "the rendered operator is left as it was"
