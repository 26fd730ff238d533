"""A real Kubernetes control plane (meshcache.ctl.kube, built by `make setup`), started once per
module: tests use their own namespaces and names."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.ctl.kube.cluster import LocalCluster, local_cluster


@pytest.fixture(scope="module")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("kube")) as cluster:
        yield cluster
