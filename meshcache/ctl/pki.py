"""A local CA and SPIFFE workload certificates (ECDSA P-256), as a mesh's CA would issue."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Identity:
    """PEM files of one certificate: its chain, its key (0600) and the CA that trusts peers."""

    cert: Path
    key: Path
    ca: Path
    # Set when the files are served to Envoy over file-based SDS: the directory whose atomic
    # `..data` symlink swap makes Envoy re-read cert, key and CA (meshcache.ctl.mesh.certs).
    sds_dir: Path | None = None


@dataclass
class CertificateAuthority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str = "meshcache local CA", days: int = 365) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshcache"),
                             x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(key=key, cert=cert)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: not an EC private key")
        return cls(key=key, cert=x509.load_pem_x509_certificate(cert_path.read_bytes()))

    def save(self, cert_path: Path, key_path: Path) -> None:
        cert_path.write_bytes(self.cert_pem())
        write_private(key_path, _private_pem(self.key))

    def issue_pem(self, spiffe_id: str, hours: float = 24.0,
                  dns_names: tuple[str, ...] = ("localhost",)) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) of a workload certificate with `spiffe_id` as its URI
        SAN, usable as client and server; valid from 5 minutes ago (clock skew) for `hours`."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshcache")]))
            .issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(hours=hours))
            .add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(spiffe_id), *(x509.DNSName(d) for d in dns_names)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _private_pem(key)

    def issue_named_pem(self, common_name: str, organizations: tuple[str, ...] = (),
                        dns_names: tuple[str, ...] = (), ip_addresses: tuple[str, ...] = (),
                        hours: float = 24.0) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) named by its subject, as Kubernetes reads client
        certificates (CN = user, O = groups), with DNS/IP SANs when it serves; client and server
        usage, valid from 5 minutes ago for `hours`."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        subject = x509.Name([*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations),
                             x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(hours=hours))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), _private_pem(key)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, spiffe_id: str, out_dir: Path, name: str, hours: float = 24.0,
              dns_names: tuple[str, ...] = ("localhost",)) -> Identity:
        """A workload certificate (see issue_pem) written as out_dir/name.crt, name.key, ca.crt."""
        cert_pem, key_pem = self.issue_pem(spiffe_id, hours, dns_names)
        out_dir.mkdir(parents=True, exist_ok=True)
        identity = Identity(cert=out_dir / f"{name}.crt", key=out_dir / f"{name}.key", ca=out_dir / "ca.crt")
        identity.cert.write_bytes(cert_pem)
        write_private(identity.key, key_pem)
        identity.ca.write_bytes(self.cert_pem())
        return identity


def spiffe_id(namespace: str, service_account: str, trust_domain: str = "cluster.local") -> str:
    return f"spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}"


def expires_within(cert_path: Path, margin: dt.timedelta) -> bool:
    """True when the certificate is missing, unreadable, or expires within `margin`."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError):
        return True
    return cert.not_valid_after_utc - dt.datetime.now(dt.UTC) < margin


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_private(path: Path, pem: bytes) -> None:
    """A private key file, 0600 from the moment it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)
