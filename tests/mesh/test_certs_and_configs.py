"""Mesh certificates (issue, keep, re-issue near expiry, 0600 keys) and the rendered sidecar configs."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshcache.contract.paths import envoy_binary
from meshcache.ctl import procs
from meshcache.ctl.envoy_config import ClientSidecar, render_client, sds_secret_paths, write
from meshcache.ctl.mesh.certs import ensure_certificates
from meshcache.ctl.mesh.config import MAX_REPLICAS, MeshConfig, Ports


def _uris(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier)


def test_issue_keep_and_reissue(tmp_path: Path) -> None:
    config = MeshConfig(state_dir=tmp_path, namespace="ml")
    first = ensure_certificates(config)
    assert first.issued == ("ca.crt", "client-sidecar.crt", "server-sidecar.crt", "control-plane.crt")
    assert _uris(first.control_plane.cert) == ["spiffe://cluster.local/ns/ml/sa/meshcache-control-plane"]
    assert _uris(first.client.cert) == ["spiffe://cluster.local/ns/ml/sa/inference-client"]
    assert _uris(first.server.cert) == ["spiffe://cluster.local/ns/ml/sa/inference-server"]
    for key in (first.client.key, first.server.key, tmp_path / "pki" / "ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    leaf = x509.load_pem_x509_certificate(first.client.cert.read_bytes())
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey) and leaf.public_key().curve.name == "secp256r1"
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert lifetime.total_seconds() <= (config.cert_hours * 3600) + 600  # short-lived

    # Still good: kept as they are.
    before = first.client.cert.read_bytes()
    assert ensure_certificates(config).issued == ()
    assert first.client.cert.read_bytes() == before

    # Near expiry (less than renew_before_hours left): re-issued by the same CA. Certificates of
    # 2 h checked by a config that renews 8 h before expiry.
    short = dataclasses.replace(config, cert_hours=2, renew_before_hours=1)
    ensure_certificates(short, force=True)
    before = first.client.cert.read_bytes()
    again = ensure_certificates(config)
    assert again.issued == ("client-sidecar.crt", "server-sidecar.crt", "control-plane.crt")
    assert again.client.cert.read_bytes() != before
    ca = x509.load_pem_x509_certificate((tmp_path / "pki" / "ca.crt").read_bytes())
    x509.load_pem_x509_certificate(again.client.cert.read_bytes()).verify_directly_issued_by(ca)

    # Another identity (namespace changed): re-issued for the new SPIFFE ID.
    moved = ensure_certificates(dataclasses.replace(config, namespace="prod"))
    assert moved.issued == ("client-sidecar.crt", "server-sidecar.crt", "control-plane.crt")
    assert _uris(moved.client.cert) == ["spiffe://cluster.local/ns/prod/sa/inference-client"]

    # Bad rotation settings are refused up front.
    with pytest.raises(ValueError, match="renew_before_hours"):
        dataclasses.replace(config, renew_before_hours=config.cert_hours + 1)


def test_rotation_swaps_the_files_atomically(tmp_path: Path) -> None:
    """What Envoy's SDS watch needs: stable links through `..data`, replaced in one rename."""
    config = MeshConfig(state_dir=tmp_path)
    certs = ensure_certificates(config)
    directory = certs.server.sds_dir
    assert directory is not None and certs.server.cert == directory / "tls.crt"
    assert os.readlink(certs.server.cert) == "..data/tls.crt" and os.readlink(certs.server.key) == "..data/tls.key"
    first_generation = os.readlink(directory / "..data")
    first_cert = certs.server.cert.read_bytes()
    rotated = ensure_certificates(config, force=True)
    assert rotated.issued == ("client-sidecar.crt", "server-sidecar.crt", "control-plane.crt")
    second_generation = os.readlink(directory / "..data")
    assert second_generation != first_generation and certs.server.cert.read_bytes() != first_cert
    # The key in place belongs to the certificate in place.
    key = serialization.load_pem_private_key(certs.server.key.read_bytes(), password=None)
    cert = x509.load_pem_x509_certificate(certs.server.cert.read_bytes())
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    assert stat.S_IMODE(certs.server.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    # One older generation is kept for a reader that resolved the link just before the swap.
    ensure_certificates(config, force=True)
    generations = sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.is_symlink()
                         and p.name.startswith(".."))
    assert len(generations) == 2 and first_generation not in generations and second_generation in generations
    assert not list(directory.glob("*_tmp"))


def test_client_sidecar_config(tmp_path: Path) -> None:
    certs = ensure_certificates(MeshConfig(state_dir=tmp_path))
    sidecar = ClientSidecar(listen_port=15001, admin_port=15000, server_ports=[15006], identity=certs.client,
                            server_identities=["spiffe://cluster.local/ns/default/sa/inference-server"],
                            color="green")
    doc = render_client(sidecar)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    # The colour is added before filters and routes see the request, unless the app set one.
    [early] = hcm["early_header_mutation_extensions"]
    assert early["typed_config"]["mutations"] == [
        {"append": {"header": {"key": "x-traffic-color", "value": "green"}, "append_action": "ADD_IF_ABSENT"}}]
    assert "hash_policy" not in hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    tls = doc["static_resources"]["clusters"][0]["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["tls_params"] == {"tls_minimum_protocol_version": "TLSv1_3",
                                 "tls_maximum_protocol_version": "TLSv1_3"}
    # Certificate and trust bundle come over file-based SDS; the allowed SAN stays in the config.
    combined = tls["combined_validation_context"]
    assert combined["default_validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "URI", "matcher": {"exact": "spiffe://cluster.local/ns/default/sa/inference-server"}}]
    cert_file, trust_file = sds_secret_paths(certs.client)
    assert tls["tls_certificate_sds_secret_configs"][0]["sds_config"]["path_config_source"]["path"] == str(cert_file)
    assert combined["validation_context_sds_secret_config"]["sds_config"]["path_config_source"]["path"] == str(
        trust_file)
    assert "tls_certificates" not in tls and "validation_context" not in tls
    path = write(sidecar, tmp_path / "client.yaml")
    secret = yaml.safe_load(cert_file.read_text())["resources"][0]["tls_certificate"]
    assert secret["certificate_chain"]["filename"] == str(certs.client.cert)  # the stable link
    assert secret["watched_directory"]["path"] == str(certs.client.sds_dir)  # the `..data` swap wakes Envoy
    trust = yaml.safe_load(trust_file.read_text())["resources"][0]["validation_context"]
    assert trust["trusted_ca"]["filename"] == str(certs.client.ca)
    # Envoy itself accepts it.
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_mesh_config_file(tmp_path: Path) -> None:
    path = tmp_path / "mesh.json"
    path.write_text('{"ports": {"app": 25001}, "color": "green", "state_dir": "/somewhere"}')
    config = MeshConfig.from_file(path, state_dir=tmp_path / "state")
    assert config.ports.app == 25001 and config.ports.server_inbound == 15006  # others keep their defaults
    assert config.color == "green" and config.state_dir == tmp_path / "state"
    path.write_text('{"colour": "green"}')
    with pytest.raises(ValueError, match="unknown settings"):
        MeshConfig.from_file(path)
    path.write_text('{"ports": {"ap": 1}}')
    with pytest.raises(ValueError, match="unknown ports"):
        MeshConfig.from_file(path)
    free = MeshConfig(state_dir=tmp_path).with_free_ports().ports
    assert len(set(vars(free).values())) == len(vars(free))  # every component its own port


def test_replica_settings_and_ports(tmp_path: Path) -> None:
    for bad in ({"replicas": 0}, {"replicas": MAX_REPLICAS + 1}, {"lb_policy": "LEAST_REQUEST"}):
        with pytest.raises(ValueError):
            MeshConfig(state_dir=tmp_path, **bad)  # type: ignore[arg-type]
    ports = Ports()
    assert ports.replica(1).server_inbound == ports.server_inbound and ports.replica(1).engine_http == 18100
    every = [p for k in range(1, MAX_REPLICAS + 1) for p in vars(ports.replica(k)).values()]
    named = [v for n, v in vars(ports).items() if n != "replica_base"]
    assert len(set(every)) == len(every) and not set(every[5:]) & set(named)  # no replica shares a port
    free = MeshConfig(state_dir=tmp_path).with_free_ports().ports
    every = [p for k in range(1, MAX_REPLICAS + 1) for p in vars(free.replica(k)).values()]
    assert len(set(every)) == len(every) and not set(every[5:]) & {v for n, v in vars(free).items()
                                                                   if n != "replica_base"}
    with pytest.raises(ValueError):
        ports.replica(MAX_REPLICAS + 1)


def test_ports_come_from_the_workers_own_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest gives each test worker its own MESHCACHE_PORT_RANGE: `free_port` walks it without
    handing out a port twice, `Ports.free` stays inside it, and a malformed range says what is wrong."""
    monkeypatch.setenv(procs.PORT_RANGE_ENV, "27000-27199")
    picked = [procs.free_port() for _ in range(150)]
    assert len(set(picked)) == len(picked) and all(27000 <= p <= 27199 for p in picked)
    ports = Ports.free()
    named = [v for n, v in vars(ports).items() if n != "replica_base"]
    assert all(27000 <= p <= 27199 for p in named)
    assert 27000 <= ports.replica(MAX_REPLICAS).engine_metrics <= 27199
    for bad in ("27000", "80-90", "2-1", "a-b", "30000-20000"):
        monkeypatch.setenv(procs.PORT_RANGE_ENV, bad)
        with pytest.raises(ValueError, match="MESHCACHE_PORT_RANGE is low-high"):
            procs.free_port()
