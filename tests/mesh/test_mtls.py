"""Strict mTLS between the sidecars, checked with real TLS clients against the server sidecar.

Only TLS 1.3 with a client certificate from the mesh CA that names the client sidecar's SPIFFE
identity gets an HTTP answer; plaintext, TLS 1.2, no certificate, another CA and another identity
get none. The client sidecar, in turn, refuses a server presenting the wrong identity. The control
plane's xDS port answers holders of a mesh-CA certificate only.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.extension.v3 import config_discovery_pb2_grpc

from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import ClientSidecar, write
from meshcache.ctl.mesh.certs import pki_dir
from meshcache.ctl.mesh.topology import Mesh
from meshcache.ctl.pki import CertificateAuthority, Identity, spiffe_id
from meshcache.ctl.procs import local_http
from tests.helpers.wait import eventually

REQUEST = b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


def _context(ca: Path, identity: Identity | None, max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    ctx.set_alpn_protocols(["http/1.1"])
    if identity is not None:
        ctx.load_cert_chain(identity.cert, identity.key)
    if max_version is not None:
        ctx.maximum_version = max_version
    return ctx


def _exchange(port: int, ctx: ssl.SSLContext) -> bytes:
    """Handshake, send one request, return what came back (b"" when the server hung up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(REQUEST)
        data = b""
        while chunk := tls.recv(4096):
            data += chunk
        return data


def _ssl_stat(mesh: Mesh, name: str) -> int:
    port = mesh.config.ports.server_inbound
    key = f"listener.127.0.0.1_{port}.ssl.{name}"
    return launchers.envoy_stats(mesh.config.ports.server_admin, key).get(key, 0)


def _refused(mesh: Mesh, ctx: ssl.SSLContext, reason: str) -> None:
    """No HTTP answer, and the server sidecar counted the refusal under `reason` (its ssl stat)."""
    before = _ssl_stat(mesh, reason)
    try:
        data = _exchange(mesh.config.ports.server_inbound, ctx)
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        data = b""
    assert not data.startswith(b"HTTP/"), data[:200]
    eventually(lambda: _ssl_stat(mesh, reason) > before, timeout=5)


@pytest.fixture(scope="module")
def ca(mesh: Mesh) -> CertificateAuthority:
    directory = pki_dir(mesh.config)
    return CertificateAuthority.load(directory / "ca.crt", directory / "ca.key")


def _port(mesh: Mesh) -> int:
    return mesh.config.ports.server_inbound


def test_the_client_identity_gets_an_answer_over_tls13(mesh: Mesh) -> None:
    assert mesh.certs is not None
    ctx = _context(mesh.certs.ca_cert, mesh.certs.client)
    with socket.create_connection(("127.0.0.1", _port(mesh)), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        assert tls.version() == "TLSv1.3"
        sans = dict(tls.getpeercert()["subjectAltName"])  # type: ignore[index]
        assert sans["URI"] == mesh.config.server_id
    assert _exchange(_port(mesh), ctx).startswith(b"HTTP/1.1 200")


def test_plaintext_is_refused(mesh: Mesh) -> None:
    before = _ssl_stat(mesh, "connection_error")
    with socket.create_connection(("127.0.0.1", _port(mesh)), timeout=5) as s:
        s.sendall(REQUEST)
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            data = b""
    assert not data.startswith(b"HTTP/")
    eventually(lambda: _ssl_stat(mesh, "connection_error") > before, timeout=5)


def test_tls12_is_refused(mesh: Mesh) -> None:
    assert mesh.certs is not None
    ctx = _context(mesh.certs.ca_cert, mesh.certs.client, max_version=ssl.TLSVersion.TLSv1_2)
    before = _ssl_stat(mesh, "connection_error")
    with pytest.raises(ssl.SSLError, match="(?i)protocol.version|unsupported.protocol"):
        _exchange(_port(mesh), ctx)
    eventually(lambda: _ssl_stat(mesh, "connection_error") > before, timeout=5)


def test_no_client_certificate_is_refused(mesh: Mesh) -> None:
    assert mesh.certs is not None
    _refused(mesh, _context(mesh.certs.ca_cert, None), "fail_verify_no_cert")


def test_a_certificate_from_another_ca_is_refused(mesh: Mesh, tmp_path: Path) -> None:
    assert mesh.certs is not None
    stranger = CertificateAuthority.create("someone else's CA").issue(mesh.config.client_id, tmp_path, "forged")
    _refused(mesh, _context(mesh.certs.ca_cert, stranger), "fail_verify_error")


def test_the_right_ca_with_a_wrong_identity_is_refused(mesh: Mesh, ca: CertificateAuthority, tmp_path: Path) -> None:
    assert mesh.certs is not None
    intruder = ca.issue(spiffe_id(mesh.config.namespace, "intruder"), tmp_path, "intruder")
    _refused(mesh, _context(mesh.certs.ca_cert, intruder), "fail_verify_san")
    # Same service account, other namespace: also not the allowed identity.
    other_ns = ca.issue(spiffe_id("other", mesh.config.client_service_account), tmp_path, "other-ns")
    _refused(mesh, _context(mesh.certs.ca_cert, other_ns), "fail_verify_san")
    # The server sidecar's own identity is not a client identity either.
    _refused(mesh, _context(mesh.certs.ca_cert, mesh.certs.server), "fail_verify_san")


@pytest.fixture
def impostor_server(ca: CertificateAuthority, tmp_path: Path) -> Iterator[tuple[int, list[bytes]]]:
    """A TLS 1.3 server with a mesh-CA certificate naming the wrong service account."""
    ident = ca.issue(spiffe_id("default", "impostor"), tmp_path, "impostor")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ident.cert, ident.key)
    ctx.set_alpn_protocols(["h2"])
    received: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.settimeout(2)
                    received.append(tls.recv(1024))
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], received
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_the_client_sidecar_refuses_a_server_with_the_wrong_identity(
        mesh: Mesh, impostor_server: tuple[int, list[bytes]], tmp_path: Path) -> None:
    assert mesh.certs is not None
    port, received = impostor_server
    listen, admin = procs.free_port(), procs.free_port()
    sidecar = ClientSidecar(listen_port=listen, admin_port=admin, server_ports=[port], identity=mesh.certs.client,
                            server_identities=[mesh.config.server_id])
    envoy = launchers.start_envoy(write(sidecar, tmp_path / "client.yaml"), admin, tmp_path)
    with procs.supervised([envoy]):
        r = local_http().get(f"http://127.0.0.1:{listen}/v2/health/ready", timeout=10)
        assert r.status_code == 503
        stats = launchers.envoy_stats(admin, "cluster.mesh_upstream.ssl")
        assert stats.get("cluster.mesh_upstream.ssl.fail_verify_san", 0) >= 1, stats
    assert not any(data for data in received), received  # no request bytes went to the impostor


# ---- the control plane's xDS port: mesh-CA client certificates only ------------------------------

def _xds_fetch(mesh: Mesh, credentials: grpc.ChannelCredentials | None) -> discovery_pb2.DiscoveryResponse:
    target = f"127.0.0.1:{mesh.config.ports.cp_xds}"
    options = [("grpc.ssl_target_name_override", "localhost")]
    channel = (grpc.secure_channel(target, credentials, options) if credentials is not None
               else grpc.insecure_channel(target))
    with channel:
        stub = config_discovery_pb2_grpc.ExtensionConfigDiscoveryServiceStub(channel)
        return stub.FetchExtensionConfigs(discovery_pb2.DiscoveryRequest(resource_names=["meshcache"]), timeout=5)


def _credentials(mesh: Mesh, identity: Identity | None) -> grpc.ChannelCredentials:
    assert mesh.certs is not None
    if identity is None:
        return grpc.ssl_channel_credentials(root_certificates=mesh.certs.ca_cert.read_bytes())
    return grpc.ssl_channel_credentials(root_certificates=mesh.certs.ca_cert.read_bytes(),
                                        private_key=identity.key.read_bytes(),
                                        certificate_chain=identity.cert.read_bytes())


def test_xds_serves_a_mesh_certificate_holder(mesh: Mesh) -> None:
    """The server sidecar's identity (what its Envoy presents) reads the filter config; the
    control plane presents its own mesh identity."""
    assert mesh.certs is not None
    resp = _xds_fetch(mesh, _credentials(mesh, mesh.certs.server))
    assert len(resp.resources) == 1 and int(resp.version_info) > 0
    with socket.create_connection(("127.0.0.1", mesh.config.ports.cp_xds), timeout=5) as raw, \
            _context(mesh.certs.ca_cert, mesh.certs.server).wrap_socket(raw, server_hostname="localhost") as tls:
        sans = dict(tls.getpeercert()["subjectAltName"])  # type: ignore[index]
        assert sans["URI"] == mesh.config.control_plane_id


@pytest.mark.parametrize("who", ["plaintext", "no certificate", "another CA"])
def test_xds_refuses_everyone_else(mesh: Mesh, who: str, tmp_path: Path) -> None:
    assert mesh.certs is not None
    if who == "plaintext":
        creds = None
    elif who == "no certificate":
        creds = _credentials(mesh, None)
    else:
        stranger = CertificateAuthority.create("someone else's CA").issue(mesh.config.server_id, tmp_path, "forged")
        creds = _credentials(mesh, stranger)
    with pytest.raises(grpc.RpcError) as info:
        _xds_fetch(mesh, creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
