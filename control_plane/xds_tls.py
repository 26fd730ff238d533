"""TLS on the xDS port, re-read from its files on every new connection.

A certificate rotation must not restart the control plane (a restart drops every xDS stream,
istiod's MCP stream included). gRPC's dynamic server credentials ask `fetch` at each new
handshake; it re-reads the PEM files (a Kubernetes Secret volume swaps them together through its
`..data` symlink) and hands gRPC the new pair only once the certificate and key match, so a
half-written update keeps the previous pair instead of failing handshakes. Connections already
open keep the session they negotiated: a switch never breaks a stream. The client CA (the local
mesh's sidecars present certificates) is re-read the same way, so it can be a bundle of an old
and a new CA during a rotation (docs/istio.md "Rotating the xDS certificates").
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from .settings import Settings

log = logging.getLogger("meshcache.control_plane.xds_tls")

Files = tuple[bytes, bytes, bytes | None]  # certificate chain, key, client CA (PEM)


def _matching_pair(cert_pem: bytes, key_pem: bytes) -> bool:
    """The chain's first certificate is the key's (what gRPC would refuse, or fail on, otherwise)."""
    # Imported here: cryptography's X.509 modules add ~50 ms to every start, and most run without TLS.
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError:
        return False
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt)


class ReloadingCredentials:
    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._files = self._read()  # at start: a missing or bad file fails startup, as before
        if not _matching_pair(self._files[0], self._files[1]):
            raise ValueError(f"{cert} and {key} are not a certificate and its key")
        self.reloads = 0

    def _read(self) -> Files:
        ca = self.client_ca.read_bytes() if self.client_ca is not None else None
        return self.cert.read_bytes(), self.key.read_bytes(), ca

    @staticmethod
    def _config(files: Files) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(files[1], files[0])], root_certificates=files[2])

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake question: a new configuration, or None to keep the current one."""
        try:
            files = self._read()
        except OSError as exc:
            log.warning("xDS TLS files unreadable (%s): keeping the certificate loaded", exc)
            return None
        if files == self._files:
            return None
        if not _matching_pair(files[0], files[1]) or (self.client_ca is not None and not files[2]):
            log.warning("xDS TLS files changed but do not form a certificate and its key (yet): keeping the "
                        "certificate loaded")
            return None
        self._files = files
        self.reloads += 1
        log.info("xDS TLS: loaded the new certificate from %s (reload %d)", self.cert, self.reloads)
        return self._config(files)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._config(self._files), self.fetch,
                                                   require_client_authentication=self.client_ca is not None)


def xds_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS for the xDS port when configured (re-read on change); a client CA makes client
    certificates mandatory."""
    if settings.xds_tls_cert is None or settings.xds_tls_key is None:
        return None
    return ReloadingCredentials(settings.xds_tls_cert, settings.xds_tls_key, settings.xds_tls_client_ca).credentials()
