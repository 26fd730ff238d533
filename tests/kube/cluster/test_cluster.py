"""The local control plane itself: kubectl talks to it, Istio's CRDs apply server-side and serve
their kinds, the controller manager turns a Deployment into Pods, the scheduler binds them, and
service-account tokens carry the `istio-ca` audience istiod's CA reviews."""

from __future__ import annotations

import json

from meshcache.ctl.kube.binary import versions
from meshcache.ctl.kube.cluster import LocalCluster
from tests.helpers.wait import eventually


def test_kubectl_and_server_report_the_pinned_version(kube_cluster: LocalCluster) -> None:
    out = json.loads(kube_cluster.kubectl("version", "-o", "json").stdout)
    pinned = versions()["KUBERNETES_VERSION"]
    assert out["clientVersion"]["gitVersion"] == pinned
    assert out["serverVersion"]["gitVersion"] == pinned


def test_istio_crds_apply_server_side_and_serve_their_kinds(istio_cluster: LocalCluster) -> None:
    kube_cluster = istio_cluster
    kube_cluster.kubectl("create", "namespace", "crd-check")
    good = {"apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
            "metadata": {"name": "engine", "namespace": "crd-check"},
            "spec": {"host": "engine.crd-check.svc.cluster.local",
                     "trafficPolicy": {"loadBalancer": {"simple": "LEAST_REQUEST"}}}}
    kube_cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(good))
    stored = kube_cluster.get("/apis/networking.istio.io/v1/namespaces/crd-check/destinationrules/engine")
    assert stored is not None and stored["spec"]["trafficPolicy"]["loadBalancer"]["simple"] == "LEAST_REQUEST"
    # The CRD's schema is enforced by the API server: an unknown enum value is refused.
    bad = json.loads(json.dumps(good))
    bad["metadata"]["name"] = "bad"
    bad["spec"]["trafficPolicy"]["loadBalancer"]["simple"] = "FASTEST"
    result = kube_cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(bad), check=False)
    assert result.returncode != 0 and "FASTEST" in result.stderr
    assert kube_cluster.get("/apis/networking.istio.io/v1/namespaces/crd-check/destinationrules/bad") is None


def test_a_deployment_becomes_pods_the_scheduler_binds(kube_cluster: LocalCluster) -> None:
    kube_cluster.kubectl("create", "namespace", "sched")
    # No kubelet here: a Node registered by hand; its pods tolerate it not being Ready.
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "test-node", "labels": {"meshcache/test": "1"}}}
    kube_cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(node))
    room = {"cpu": "2", "memory": "4Gi", "pods": "10"}  # the scheduler fits pods to allocatable
    kube_cluster.kubectl("patch", "node", "test-node", "--subresource=status", "--type=merge",
                         "-p", json.dumps({"status": {"capacity": room, "allocatable": room}}))
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "sched"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"tolerations": [{"operator": "Exists"}],
                                       "nodeSelector": {"meshcache/test": "1"},
                                       "containers": [{"name": "web", "image": "example.invalid/web:1"}]}}}}
    kube_cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(deployment))

    def bound() -> list[dict]:
        pods = kube_cluster.get("/api/v1/namespaces/sched/pods")
        items = pods["items"] if pods else []
        return items if len(items) == 2 and all(p["spec"].get("nodeName") == "test-node" for p in items) else []

    pods = eventually(bound, timeout=60)
    # The controller manager's ServiceAccount admission ran: the pods got the namespace's default.
    assert {p["spec"]["serviceAccountName"] for p in pods} == {"default"}


def test_service_account_tokens_carry_the_istio_ca_audience(kube_cluster: LocalCluster) -> None:
    kube_cluster.kubectl("create", "namespace", "tokens")
    kube_cluster.kubectl("create", "serviceaccount", "app", "-n", "tokens")
    token = kube_cluster.kubectl("create", "token", "app", "-n", "tokens", "--audience", "istio-ca").stdout.strip()
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
              "spec": {"token": token, "audiences": ["istio-ca"]}}
    with kube_cluster.api() as api:
        status = api.post("/apis/authentication.k8s.io/v1/tokenreviews", json=review).json()["status"]
        assert status["authenticated"] is True
        assert status["user"]["username"] == "system:serviceaccount:tokens:app"
        assert status["audiences"] == ["istio-ca"]
        # A token for another audience is not accepted as istio-ca's.
        other = kube_cluster.kubectl("create", "token", "app", "-n", "tokens", "--audience", "other").stdout.strip()
        review["spec"]["token"] = other
        assert api.post("/apis/authentication.k8s.io/v1/tokenreviews", json=review).json()["status"].get(
            "authenticated") is not True
