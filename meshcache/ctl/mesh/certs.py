"""The mesh's local CA and the sidecars' workload certificates, (re-)issued at `meshcache up`.

Workload certificates are short-lived (MeshConfig.cert_hours); `ensure_certificates` keeps the
ones that are still good and issues new ones when a certificate is near expiry, names another
identity, or was not signed by the current CA. Private keys are written 0600 (meshcache.ctl.pki).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.pki import CertificateAuthority, Identity, expires_within

CA_DAYS = 365
CA_RENEW_BEFORE = dt.timedelta(days=30)
CLIENT_NAME = "client-sidecar"
SERVER_NAME = "server-sidecar"
CONTROL_PLANE_NAME = "control-plane"  # the xDS port's server certificate


@dataclass(frozen=True)
class MeshCertificates:
    ca_cert: Path
    client: Identity
    server: Identity
    control_plane: Identity
    issued: tuple[str, ...]  # which files were (re-)issued by this call, for the log


def pki_dir(config: MeshConfig) -> Path:
    return config.state_dir / "pki"


def _load_or_create_ca(directory: Path) -> tuple[CertificateAuthority, bool]:
    cert_path, key_path = directory / "ca.crt", directory / "ca.key"
    if cert_path.exists() and key_path.exists() and not expires_within(cert_path, CA_RENEW_BEFORE):
        return CertificateAuthority.load(cert_path, key_path), False
    ca = CertificateAuthority.create(name="meshcache local mesh CA", days=CA_DAYS)
    ca.save(cert_path, key_path)
    return ca, True


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


def ensure_certificates(config: MeshConfig) -> MeshCertificates:
    directory = pki_dir(config)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca, new_ca = _load_or_create_ca(directory)
    issued = ["ca.crt"] if new_ca else []
    margin = dt.timedelta(hours=config.renew_before_hours)
    identities: dict[str, Identity] = {}
    for name, spiffe in ((CLIENT_NAME, config.client_id), (SERVER_NAME, config.server_id),
                         (CONTROL_PLANE_NAME, config.control_plane_id)):
        existing = Identity(directory / f"{name}.crt", directory / f"{name}.key", directory / "ca.crt")
        if not new_ca and existing.key.exists() and _still_good(existing.cert, ca, spiffe, margin):
            identities[name] = existing
            continue
        identities[name] = ca.issue(spiffe, directory, name, hours=config.cert_hours)
        issued.append(f"{name}.crt")
    return MeshCertificates(directory / "ca.crt", identities[CLIENT_NAME], identities[SERVER_NAME],
                            identities[CONTROL_PLANE_NAME], tuple(issued))
