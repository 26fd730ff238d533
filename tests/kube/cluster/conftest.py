"""A real Kubernetes control plane (meshcache.ctl.kube, built by `make setup`), started once per
worker for every module here (tests/conftest.py SHARED_STACK_DIRS keeps them on one worker): tests
use their own namespaces and names."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.contract import extensions
from meshcache.ctl.istio import validate
from meshcache.ctl.kube.cluster import LocalCluster, local_cluster
from tests.helpers.wait import eventually


@pytest.fixture(scope="package")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("kube")) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def istio_cluster(kube_cluster: LocalCluster) -> LocalCluster:
    """The cluster with Istio's CRDs, applied as istio installs do here (the field manager
    meshcache.ctl.kube.istiod re-applies them with) and served."""
    kube_cluster.kubectl("apply", "--server-side", "--field-manager=meshcache", "-f", str(validate.crd_file()))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    # Established is not yet served: the API server answers 429 until the kinds' storage is up.
    for path in (extensions.KUBE_RESOURCES["EnvoyFilter"].path("default"),
                 extensions.KUBE_RESOURCES["TrafficExtension"].path("default"),
                 "/apis/networking.istio.io/v1/namespaces/default/destinationrules",
                 "/apis/security.istio.io/v1/namespaces/default/authorizationpolicies"):
        eventually(lambda p=path: kube_cluster.get(p) is not None, timeout=60)
    return kube_cluster
