"""Certificate rotation over Envoy's file-based SDS, on a real mesh.

- A forced rotation: both sidecars load the new certificates without a restart, an open mTLS
  connection keeps working, new handshakes see the new certificate, the cache survives (a hit).
- An expired certificate from the mesh CA is refused.
- 30-second certificates under `meshcache up`: the supervisor rotates them, and the mesh keeps
  answering (right, and from the same cache) after the first certificates have expired.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from meshcache.ctl import launchers
from meshcache.ctl.mesh import state
from meshcache.ctl.mesh.certs import pki_dir
from meshcache.ctl.mesh.config import MeshConfig, Ports
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh
from meshcache.ctl.pki import CertificateAuthority, Identity
from meshcache.ctl.procs import local_http
from tests.helpers.kserve import mlp_json, rest_infer
from tests.helpers.load import KINDS, Load, expected_answers
from tests.helpers.tls import serial_of
from tests.helpers.wait import eventually

REQUEST = b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\n\r\n"
CLI = [str(Path(sys.executable).parent / "meshcache")]


@pytest.fixture(scope="module")
def own_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = dataclasses.replace(MeshConfig(state_dir=tmp_path_factory.mktemp("rotation")),
                                 canary_color="").with_free_ports()
    with Mesh(config, log=lambda _: None) as m:
        yield m


def _tls(mesh: Mesh, identity: Identity) -> ssl.SSLContext:
    assert mesh.certs is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(mesh.certs.ca_cert)
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.load_cert_chain(identity.cert, identity.key)
    return ctx


def _read_response(tls: ssl.SSLSocket) -> bytes:
    """One keep-alive HTTP/1.1 response (the readiness answer is small: headers + short body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = tls.recv(4096)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += tls.recv(4096)
    return head


def _presented_serial(mesh: Mesh) -> int:
    """The serial of the certificate the server sidecar shows in a new handshake."""
    assert mesh.certs is not None
    with socket.create_connection(("127.0.0.1", mesh.config.ports.server_inbound), timeout=5) as raw, \
            _tls(mesh, mesh.certs.client).wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number


def _loaded_serials(admin_port: int) -> set[int]:
    """Serials of the certificates an Envoy has loaded (admin /certs)."""
    doc = local_http().get(f"http://127.0.0.1:{admin_port}/certs", timeout=5).json()
    return {int(c["serial_number"], 16) for entry in doc["certificates"] for c in entry.get("cert_chain", [])}


def _file_serial(path: Path) -> int:
    return serial_of(path.read_bytes())


def test_rotation_keeps_connections_and_cache(own_mesh: Mesh) -> None:
    mesh, ports = own_mesh, own_mesh.config.ports
    assert mesh.certs is not None
    app = mesh.endpoints()["app"]
    body = mlp_json(seed=8801)
    stored = rest_infer(app, "mlp-classifier", body)
    assert stored.headers["cache-status"] == "meshcache; fwd=miss; stored"
    pids = {p.name: p.popen.pid for p in mesh.procs}
    old_server, old_client = _file_serial(mesh.certs.server.cert), _file_serial(mesh.certs.client.cert)
    assert _presented_serial(mesh) == old_server
    with socket.create_connection(("127.0.0.1", ports.server_inbound), timeout=5) as raw, \
            _tls(mesh, mesh.certs.client).wrap_socket(raw, server_hostname="localhost") as open_conn, \
            httpx.Client(timeout=10) as app_client:
        open_conn.sendall(REQUEST)
        assert _read_response(open_conn).startswith(b"HTTP/1.1 200")
        assert app_client.get(f"http://{app}/v2/health/ready").status_code == 200

        issued = mesh.refresh_certificates(force=True)
        assert issued == ("client-sidecar.crt", "server-sidecar.crt", "control-plane.crt")
        new_server, new_client = _file_serial(mesh.certs.server.cert), _file_serial(mesh.certs.client.cert)
        assert new_server != old_server and new_client != old_client
        # Both sidecars load the new certificate (no restart): new handshakes show it.
        eventually(lambda: _presented_serial(mesh) == new_server, timeout=10)
        eventually(lambda: new_client in _loaded_serials(ports.client_admin), timeout=10)
        assert new_server in _loaded_serials(ports.server_admin)
        # The connection opened before the rotation still works, and so does the app's.
        open_conn.sendall(REQUEST)
        assert _read_response(open_conn).startswith(b"HTTP/1.1 200")
        assert app_client.get(f"http://{app}/v2/health/ready").status_code == 200
    # The cache survived: the entry stored before the rotation is a hit with the same bytes.
    hit = rest_infer(app, "mlp-classifier", body)
    assert hit.headers["cache-status"].startswith("meshcache; hit") and hit.content == stored.content
    # No sidecar was restarted; the control plane was, to load its new xDS certificate, and the
    # server sidecar's xDS client (its certificate also over SDS) talks to it again.
    now = {p.name: p.popen.pid for p in mesh.procs}
    assert now.pop("control-plane") != pids.pop("control-plane")
    assert now == pids and all(p.alive() for p in mesh.procs)
    with mesh.api() as api:
        version = api.put("resnet-mini", {"ttl_s": 77})["version"]
        api.wait_acked(SERVER_NODE, version, timeout=20)
    for admin in (ports.server_admin, ports.client_admin):
        stats = launchers.envoy_stats(admin, "sds.workload_certificate")
        assert stats["sds.workload_certificate.update_rejected"] == 0
        assert stats["sds.workload_certificate.key_rotation_failed"] == 0


def test_an_expired_certificate_is_refused(own_mesh: Mesh, tmp_path: Path) -> None:
    mesh = own_mesh
    directory = pki_dir(mesh.config)
    ca = CertificateAuthority.load(directory / "ca.crt", directory / "ca.key")
    # The right CA and the client sidecar's identity, but it ended a minute ago.
    expired = ca.issue(mesh.config.client_id, tmp_path, "expired", hours=-1 / 60)
    assert x509.load_pem_x509_certificate(expired.cert.read_bytes()).not_valid_after_utc < dt.datetime.now(dt.UTC)
    key = f"listener.127.0.0.1_{mesh.config.ports.server_inbound}.ssl.fail_verify_error"
    before = launchers.envoy_stats(mesh.config.ports.server_admin, key).get(key, 0)
    try:
        with socket.create_connection(("127.0.0.1", mesh.config.ports.server_inbound), timeout=5) as raw, \
                _tls(mesh, expired).wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(REQUEST)
            answer = tls.recv(4096)
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        answer = b""
    assert not answer.startswith(b"HTTP/")
    eventually(lambda: launchers.envoy_stats(mesh.config.ports.server_admin, key).get(key, 0) > before, timeout=5)
    # The current certificate of the same identity is accepted.
    assert mesh.certs is not None
    with socket.create_connection(("127.0.0.1", mesh.config.ports.server_inbound), timeout=5) as raw, \
            _tls(mesh, mesh.certs.client).wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(REQUEST)
        assert _read_response(tls).startswith(b"HTTP/1.1 200")


def test_short_certificates_are_rotated_by_the_running_mesh(tmp_path: Path) -> None:
    """`meshcache up` with 30 s certificates renewed 20 s before expiry (a rotation every ~10 s,
    checked every second): traffic keeps working (every answer checked) past the first
    certificates' expiry, with the same cache, no restart."""
    state_dir, ports = tmp_path / "state", Ports.free()
    config = tmp_path / "mesh.json"
    config.write_text(json.dumps({
        "ports": asdict(ports), "policies": {"mlp-classifier": {"ttl_s": 600, "max_ttl_s": 1800}},
        "cert_hours": 30 / 3600, "renew_before_hours": 20 / 3600, "cert_check_s": 1}))
    try:
        up = subprocess.run([*CLI, "up", "--detach", "--config", str(config), "--state-dir", str(state_dir)],
                            capture_output=True, text=True, timeout=240)
        assert up.returncode == 0, up.stdout + up.stderr
        first_cert = state_dir / "pki" / "server-sidecar" / "tls.crt"
        first_expiry = x509.load_pem_x509_certificate(first_cert.read_bytes()).not_valid_after_utc
        app = f"127.0.0.1:{ports.app}"
        body = mlp_json(seed=8802)
        stored = rest_infer(app, "mlp-classifier", body)
        assert stored.status_code == 200
        expected = expected_answers(ports.engine_http, ports.engine_grpc, ports.canary_http)
        load = Load(app, expected, threads=1, pause_s=0.05).start()
        serials: set[int] = set()
        try:
            # Until the first certificates have expired (and a little longer), the supervisor has
            # rotated twice, Envoy was seen loading a rotation and the load made 100 calls (a slow
            # `up` eats into the window; rotations are paced by the check, not by this loop).
            log_file = state_dir / "logs" / "supervisor.log"
            deadline = first_expiry + dt.timedelta(seconds=60)
            while dt.datetime.now(dt.UTC) < first_expiry + dt.timedelta(seconds=2) or len(serials) < 2 \
                    or len(load.outcomes) <= 100 or log_file.read_text().count("rotated certificates") < 2:
                assert dt.datetime.now(dt.UTC) < deadline, (serials, len(load.outcomes), log_file.read_text()[-2000:])
                serials |= _loaded_serials(ports.server_admin)
                time.sleep(0.5)
        finally:
            load.stop()
        assert not [o for o in load.outcomes if not o.ok], [o for o in load.outcomes if not o.ok][:5]
        assert {o.kind for o in load.outcomes} == {k.name for k in KINDS} and len(load.outcomes) > 100
        # Still answering after the first certificates expired, from the same cache.
        hit = rest_infer(app, "mlp-classifier", body)
        assert hit.headers["cache-status"].startswith("meshcache; hit") and hit.content == stored.content
        # Healthy (the control plane may be restarting right now to load its own new certificate).
        deadline = time.monotonic() + 60
        while True:
            status = subprocess.run([*CLI, "status", "--json", "--state-dir", str(state_dir)], capture_output=True,
                                    text=True, timeout=60)
            report = json.loads(status.stdout)
            if status.returncode == 0 and report["healthy"]:
                break
            assert time.monotonic() < deadline, report
            time.sleep(0.5)
        assert all(c["restarts"] == 0 for c in report["components"].values())  # rotation restarted nothing
        now_valid_until = dt.datetime.fromisoformat(report["certificates"]["server-sidecar"].replace("Z", "+00:00"))
        assert now_valid_until > first_expiry
    finally:
        state.stop_mesh(state_dir, timeout=30)
