"""One Kubernetes-mode mesh per worker for the modules of tests/kube/mesh/ and
tests/kube/mesh_rollouts/ (tests/conftest.py SHARED_STACK_DIRS keeps each directory on one worker:
the two run side by side, each on its own mesh, or share one): the local cluster, istiod with its webhooks and CA, the
meshcache control plane as its MCP source, the test kubelet running the rendered istio/ objects
applied with `kubectl apply --server-side`, and the demo policies. Tests use their own names for
what they add, and leave the rendered objects as they found them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshcache.ctl.kube.mesh import KubeMesh, KubeMeshConfig

CERT_TTL_S = 40  # short workload certificates: the agents rotate them every ~20 s


@pytest.fixture(scope="package")
def kube_mesh(tmp_path_factory: pytest.TempPathFactory, filter_wasm: Path) -> Iterator[KubeMesh]:
    config = KubeMeshConfig(tmp_path_factory.mktemp("kube-mesh"), module=filter_wasm, kubelet=True,
                            seed_policies=True, workload_cert_ttl=f"{CERT_TTL_S}s")
    with KubeMesh(config) as mesh:
        mesh.apply_rendered()
        yield mesh
