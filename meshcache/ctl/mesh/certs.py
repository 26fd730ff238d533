"""The mesh's local CA and the sidecars' workload certificates, issued at `up` and rotated while it runs.

Each sidecar's files live in their own directory, laid out as Kubernetes lays out a mounted
Secret, so Envoy's file-based SDS can watch it (meshcache.ctl.envoy_config, "file-based SDS"):

    pki/<sidecar>/..2026_12_01T06_50_00.123456/{tls.crt,tls.key,ca.crt}   one generation
    pki/<sidecar>/..data -> ..2026_12_01T06_50_00.123456                    the current one
    pki/<sidecar>/{tls.crt,tls.key,ca.crt} -> ..data/<file>                  what Envoy reads

A rotation writes a new generation directory, then renames a fresh symlink over `..data`: one
atomic step, so Envoy (woken by the rename in the watched directory) never reads a new
certificate with an old key. The previous generation stays until the next rotation, for a reader
that resolved the old link just before the swap.

`ensure_certificates` keeps certificates that are still good and issues new ones when one is near
expiry (less than `renew_before_hours` left), names another identity, or was not signed by the
current CA. `meshcache up` calls it at start and then periodically (`rotation_check_s`). The
trust bundle holds the current CA and, after a CA renewal, the previous one while it is valid, so
sidecars that rotate a moment apart still trust each other. Keys are 0600, directories 0700.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.pki import CertificateAuthority, Identity, expires_within, write_private

CA_DAYS = 365
CA_RENEW_BEFORE = dt.timedelta(days=30)
CLIENT_NAME = "client-sidecar"
SERVER_NAME = "server-sidecar"
CONTROL_PLANE_NAME = "control-plane"  # the xDS port's server certificate
CERT_FILE, KEY_FILE, TRUST_FILE = "tls.crt", "tls.key", "ca.crt"
DATA_LINK = "..data"


@dataclass(frozen=True)
class MeshCertificates:
    ca_cert: Path
    client: Identity
    server: Identity
    control_plane: Identity
    issued: tuple[str, ...]  # which files were (re-)issued by this call, for the log


def pki_dir(config: MeshConfig) -> Path:
    return config.state_dir / "pki"


def sidecar_identity(directory: Path) -> Identity:
    """A sidecar's identity as Envoy sees it: the stable links, served over SDS."""
    return Identity(directory / CERT_FILE, directory / KEY_FILE, directory / TRUST_FILE, sds_dir=directory)


def _load_or_create_ca(directory: Path) -> tuple[CertificateAuthority, bool]:
    cert_path, key_path = directory / "ca.crt", directory / "ca.key"
    if cert_path.exists() and key_path.exists() and not expires_within(cert_path, CA_RENEW_BEFORE):
        return CertificateAuthority.load(cert_path, key_path), False
    if cert_path.exists():  # renewal: the old CA stays trusted while certificates it signed live
        shutil.copyfile(cert_path, directory / "ca-previous.crt")
    ca = CertificateAuthority.create(name="meshcache local mesh CA", days=CA_DAYS)
    ca.save(cert_path, key_path)
    return ca, True


def trust_bundle(directory: Path, ca: CertificateAuthority) -> bytes:
    bundle = ca.cert_pem()
    previous = directory / "ca-previous.crt"
    if previous.exists() and not expires_within(previous, dt.timedelta(0)):
        bundle += previous.read_bytes()
    return bundle


def _still_good(path: Path, ca: CertificateAuthority, identity: str, margin: dt.timedelta) -> bool:
    if expires_within(path, margin):
        return False
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        return False
    if uris != [identity]:
        return False
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _replace_link(link: Path, target: str) -> None:
    """Point `link` at `target` atomically (a new symlink renamed over the old one)."""
    tmp = link.with_name(f"{link.name}_tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def publish(directory: Path, cert_pem: bytes, key_pem: bytes, trust_pem: bytes) -> None:
    """Make (cert, key, trust bundle) the directory's current generation in one atomic rename."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    generation = directory / f"..{time.strftime('%Y_%m_%dT%H_%M_%S', time.gmtime())}.{time.time_ns() % 10**9:09d}"
    generation.mkdir(mode=0o700)
    (generation / CERT_FILE).write_bytes(cert_pem)
    write_private(generation / KEY_FILE, key_pem)
    (generation / TRUST_FILE).write_bytes(trust_pem)
    data = directory / DATA_LINK
    previous = os.readlink(data) if data.is_symlink() else None
    _replace_link(data, generation.name)
    for name in (CERT_FILE, KEY_FILE, TRUST_FILE):
        link = directory / name
        if not (link.is_symlink() and os.readlink(link) == f"{DATA_LINK}/{name}"):
            _replace_link(link, f"{DATA_LINK}/{name}")
    for old in directory.glob("..*"):
        if old.is_dir() and not old.is_symlink() and old.name not in (generation.name, previous):
            shutil.rmtree(old, ignore_errors=True)


def ensure_certificates(config: MeshConfig, force: bool = False) -> MeshCertificates:
    """Keep good certificates, (re-)issue the others; `force` re-issues the workload ones now."""
    directory = pki_dir(config)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca, new_ca = _load_or_create_ca(directory)
    issued = ["ca.crt"] if new_ca else []
    margin = dt.timedelta(hours=config.renew_before_hours)
    bundle = trust_bundle(directory, ca)
    identities: dict[str, Identity] = {}
    for name, spiffe in ((CLIENT_NAME, config.client_id), (SERVER_NAME, config.server_id)):
        identity = sidecar_identity(directory / name)
        keep = (not force and not new_ca and identity.key.exists()
                and _still_good(identity.cert, ca, spiffe, margin) and identity.ca.read_bytes() == bundle)
        if not keep:
            cert_pem, key_pem = ca.issue_pem(spiffe, hours=config.cert_hours)
            publish(directory / name, cert_pem, key_pem, bundle)
            issued.append(f"{name}.crt")
        identities[name] = identity
    # The control plane reads its xDS certificate when it starts (plain files); whoever runs it
    # restarts it when this one is re-issued (Mesh.refresh_certificates).
    name = CONTROL_PLANE_NAME
    existing = Identity(directory / f"{name}.crt", directory / f"{name}.key", directory / "ca.crt")
    if not force and not new_ca and existing.key.exists() and _still_good(existing.cert, ca,
                                                                          config.control_plane_id, margin):
        identities[name] = existing
    else:
        identities[name] = ca.issue(config.control_plane_id, directory, name, hours=config.cert_hours)
        issued.append(f"{name}.crt")
    return MeshCertificates(directory / "ca.crt", identities[CLIENT_NAME], identities[SERVER_NAME],
                            identities[CONTROL_PLANE_NAME], tuple(issued))


def not_after(path: Path) -> dt.datetime:
    return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc
