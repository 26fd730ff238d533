"""Certificate serials: of a PEM, and of what a local TLS port presents to a new handshake."""

from __future__ import annotations

import ssl

from cryptography import x509


def serial_of(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def presented_serial(port: int) -> int:
    """The serial of the certificate 127.0.0.1:`port` shows a new handshake."""
    return serial_of(ssl.get_server_certificate(("127.0.0.1", port), timeout=5).encode())
