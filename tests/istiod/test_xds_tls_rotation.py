"""The xDS certificate rotation runbook (docs/istio.md, "Rotating the xDS certificates") with the
real istiod and sidecars under load: `meshcache istio xds-certs --new-ca`, istiod restarted
trusting the bundle of both CAs, the control plane's serving certificate switched (re-read, no
restart), istiod restarted again (a reconnect meets the new certificate), the old CA dropped.
No request fails, hits keep being served, policies keep flowing, and the cache survives.

istiod takes its trust from its mesh config: on a cluster the Secret of `credentialName`, here
`caCertificates` inline (meshcache/ctl/istiod/translate.py); it reads either when it starts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from meshcache.ctl.cli import main
from meshcache.ctl.istiod.mesh import IstiodMesh
from tests.helpers.kserve import mlp_json
from tests.helpers.tls import presented_serial, serial_of
from tests.helpers.wait import eventually
from tests.istiod.helpers import SEEDS, istiod_mesh, put_and_sync, rest_infer, warmed_load


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IstiodMesh]:
    with istiod_mesh(tmp_path_factory, "istiod-xds-rotation", canary_color="") as m:
        yield m


def istiod_trusts(mesh: IstiodMesh, bundle: bytes) -> None:
    """istiod restarted with `bundle` as the control plane's CA (the Secret's `ca.crt` on a
    cluster): ready only once it synced the control plane over TLS (mesh.restart waits)."""
    assert mesh.istiod is not None
    path = mesh.istiod.mesh_config
    config = yaml.safe_load(path.read_text())
    sources = [s for s in config["configSources"] if "tlsSettings" in s]
    assert len(sources) == 1
    sources[0]["tlsSettings"]["caCertificates"] = bundle.decode()
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    mesh.restart("istiod")


def publish(served: Path, certs: Path) -> None:
    """The serving certificate's Secret updated: each file replaced atomically (the control plane
    loads the pair once both match)."""
    for name in ("tls.crt", "tls.key"):
        tmp = served / f".{name}.new"
        shutil.copy(certs / name, tmp)
        os.replace(tmp, served / name)


def test_rotation_with_overlap_under_load(mesh: IstiodMesh, tmp_path: Path) -> None:
    served = mesh.work / "xds-tls"  # what the control plane serves (its Secret volume)
    certs = tmp_path / "certs"  # the operator's directory, the CA key in it
    shutil.copytree(served, certs)
    ca1 = (certs / "ca.crt").read_bytes()
    namespace = mesh.config.namespace
    with warmed_load(mesh) as load:
        load.wait_hits(0)
        # 1. A new CA; istiod trusts both (restarted: it reads its trust at start).
        assert main(["istio", "xds-certs", "--namespace", namespace, "--out", str(certs), "--new-ca"]) == 0
        ca2 = (certs / "ca.crt").read_bytes()
        assert (certs / "ca-bundle.crt").read_bytes() == ca2 + ca1
        istiod_trusts(mesh, (certs / "ca-bundle.crt").read_bytes())
        put_and_sync(mesh, 131)
        load.wait_hits(load.hits)
        # 2. The serving certificate switches; istiod's open stream carries on, and a reconnect
        #    (istiod restarted) verifies the new certificate against the bundle.
        before = presented_serial(mesh.cp_xds)
        publish(served, certs)
        eventually(lambda: presented_serial(mesh.cp_xds) != before, timeout=10)
        put_and_sync(mesh, 132)
        mesh.restart("istiod")
        put_and_sync(mesh, 133)
        load.wait_hits(load.hits)
        # 3. The old CA leaves the bundle.
        assert main(["istio", "xds-certs", "--namespace", namespace, "--out", str(certs), "--drop-old-ca"]) == 0
        assert (certs / "ca-bundle.crt").read_bytes() == ca2
        istiod_trusts(mesh, ca2)
        put_and_sync(mesh, 134)
        load.wait_hits(load.hits)
    print(f"rotation under load: {len(load.outcomes)} answers, {load.hits} hits, {len(load.failed())} wrong or failed")
    assert not load.failed(), load.failed()[:5]
    assert presented_serial(mesh.cp_xds) == serial_of((certs / "tls.crt").read_bytes())
    # The cache survived every step: the warmed answers are still hits.
    assert all(rest_infer(mesh, "mlp-classifier", mlp_json(s)).headers["cache-status"].startswith("meshcache; hit")
               for s in SEEDS)
