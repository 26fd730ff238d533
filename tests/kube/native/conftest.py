"""Istio 1.31's mesh in the local Kubernetes, through istiod's real injection (issue 37): one
minimal kube mesh for this directory (tests/conftest.py SHARED_STACK_DIRS keeps it on one worker)
rendered with `--filter native --istio-version 1.31`: the control plane in native mode (one
replica), Redis, one engine pod whose init container `meshcache-module` copies the 1.39 module
from the module image (module_image.py) into an emptyDir that the classic istio-proxy sidecar
mounts, every sidecar on Envoy 1.39, and a caller pod (no affinity label: no client role).
Tests use their own names for what they add."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshcache.ctl.istio import render
from meshcache.ctl.kube.mesh import KubeMesh, KubeMeshConfig
from meshcache.ctl.kube.up import scale_engine
from tests.kube.mesh.helpers import NATIVE_CALLER, caller_pod

COMPONENT_LOG_LEVEL = "sidecar.istio.io/componentLogLevel"
MODULE_LOG_LEVEL = "misc:error,dynamic_modules:info"


@pytest.fixture(scope="package")
def native_kube_mesh(tmp_path_factory: pytest.TempPathFactory, filter_wasm: Path) -> Iterator[KubeMesh]:
    config = KubeMeshConfig(tmp_path_factory.mktemp("kube-native"), module=filter_wasm, kubelet=True,
                            seed_policies=True, filter="native", control_plane_replicas=1)
    with KubeMesh(config) as mesh:
        objects = scale_engine(mesh.objects, 1)  # one engine pod: no affinity needed for hits
        for obj in objects:  # docs' "Confirm on a cluster": Envoy logs the module's ABI match
            if obj["kind"] == "Deployment" and obj["metadata"].get("labels", {}).get("app") == render.ENGINE_APP:
                obj["spec"]["template"]["metadata"]["annotations"][COMPONENT_LOG_LEVEL] = MODULE_LOG_LEVEL
        mesh.apply_rendered(objects)
        caller_pod(mesh, NATIVE_CALLER, "meshcache-client")  # started while the engine pod starts
        yield mesh
