"""The API server connection of `--delivery kube` (control_plane/kube_client.py): kubeconfig and
in-cluster settings read as kubectl and client-go read them, and unusable ones refused at startup
with what is wrong. (Talking to a real API server: tests/kube/test_kube_delivery.py.)"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from meshcache.control_plane import cli, kube_client
from meshcache.control_plane.kube_client import KubeConfigError
from meshcache.ctl.pki import CertificateAuthority, spiffe_id
from tests.helpers.control_plane import TOKENS


def _kubeconfig(path: Path, cluster: dict, user: dict) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    authority = CertificateAuthority.create()
    (tmp_path / "ca.crt").write_bytes(authority.cert_pem())
    return authority


def test_kubeconfig_token_file_relative_paths_and_inline_client_certificates(tmp_path: Path,
                                                                             ca: CertificateAuthority) -> None:
    (tmp_path / "token").write_text("first\n")
    cluster = {"server": "https://127.0.0.1:6443/", "certificate-authority": "ca.crt"}
    conn = kube_client.from_kubeconfig(_kubeconfig(tmp_path / "a.kubeconfig", cluster, {"tokenFile": "token"}))
    assert conn.server == "https://127.0.0.1:6443" and conn.token is not None and conn.token() == "first"
    assert "context c" in conn.source

    cert, key = ca.issue_pem(spiffe_id("ns", "sa"))
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    conn = kube_client.from_kubeconfig(_kubeconfig(
        tmp_path / "b.kubeconfig", {"server": "https://h:1", "certificate-authority-data": b64(ca.cert_pem())},
        {"client-certificate-data": b64(cert), "client-key-data": b64(key)}))
    assert conn.token is None and conn.verify.cert_store_stats()["x509_ca"] == 1
    assert not list(tmp_path.glob("meshcache-kube-*"))  # the inline key is not left on disk


@pytest.mark.parametrize(("cluster", "user", "message"), [
    ({"server": "http://h:1"}, {"token": "t"}, "not https"),
    ({"server": "https://h:1", "insecure-skip-tls-verify": True}, {"token": "t"}, "insecure-skip-tls-verify"),
    ({"server": "https://h:1"}, {"exec": {"command": "aws"}}, "has exec"),
    ({"server": "https://h:1"}, {"tokenFile": "missing"}, "cannot read the token"),
])
def test_unusable_kubeconfigs_are_refused(tmp_path: Path, cluster: dict, user: dict, message: str) -> None:
    with pytest.raises(KubeConfigError, match=message):
        kube_client.from_kubeconfig(_kubeconfig(tmp_path / "k", cluster, user))
    with pytest.raises(KubeConfigError, match="cannot read kubeconfig"):
        kube_client.from_kubeconfig(tmp_path / "absent")


def test_in_cluster_reads_the_service_account_mount(tmp_path: Path, ca: CertificateAuthority) -> None:
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        kube_client.in_cluster(tmp_path, env={})
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubeConfigError, match="automountServiceAccountToken"):
        kube_client.in_cluster(tmp_path / "nothing", env=env)
    (tmp_path / "token").write_text("sa-token")
    conn = kube_client.in_cluster(tmp_path, env=env)
    assert conn.server == "https://[fd00::1]:443" and conn.token is not None and conn.token() == "sa-token"


def test_the_control_plane_refuses_to_start_without_an_api_server(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MESHCACHE_CP_TOKENS", TOKENS)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cli.main(["--delivery", "kube"]) == 2
    assert "KUBERNETES_SERVICE_HOST" in capsys.readouterr().err
    assert cli.main(["--delivery", "kube", "--kubeconfig", str(tmp_path / "absent")]) == 2
    assert "cannot read kubeconfig" in capsys.readouterr().err


def test_delivery_kube_serves_nothing_of_it_over_mcp_and_workers_do_not_write(tmp_path: Path,
                                                                              ca: CertificateAuthority) -> None:
    from meshcache.control_plane.mcp import ENVOY_FILTER_TYPE_URL, EmptyMcpRenderer
    from meshcache.control_plane.settings import Settings
    from meshcache.control_plane.wiring import ControlPlane

    kubeconfig = _kubeconfig(tmp_path / "k", {"server": "https://127.0.0.1:1", "certificate-authority": "ca.crt"},
                             {"token": "t"})
    pin = {"istio_wasm_url": "oci://r/f@sha256:" + "a" * 64, "istio_wasm_sha256": "a" * 64, "tokens": TOKENS}
    main = ControlPlane(Settings(delivery="kube", kubeconfig=kubeconfig, **pin))
    worker = ControlPlane(Settings(delivery="kube", kubeconfig=kubeconfig, kube_write=False, **pin))
    mcp = ControlPlane(Settings(**pin))
    assert main.kube_writer is not None and main.kube_writer.resource.plural == "envoyfilters"
    assert worker.kube_writer is None and mcp.kube_writer is None
    # An istiod still pointed at a kube-delivery control plane gets an empty answer, never a second copy.
    assert isinstance(main.xds.renderer_for(ENVOY_FILTER_TYPE_URL), EmptyMcpRenderer)
    assert not isinstance(mcp.xds.renderer_for(ENVOY_FILTER_TYPE_URL), EmptyMcpRenderer)
