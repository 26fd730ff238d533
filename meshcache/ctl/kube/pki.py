"""The local cluster's PKI: one CA (meshcache.ctl.pki) signing the API server's serving
certificate and a client certificate per component (CN = user, O = groups, as the API server reads
them), the service-account signing key pair, and kubeconfig files that embed them."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshcache.ctl.pki import CertificateAuthority, write_private

# The `kubernetes` Service's ClusterIP (the first of cluster.SERVICE_CIDR): in-cluster clients'
# KUBERNETES_SERVICE_HOST (kubelet.py), in the certificate as a real cluster's API server has it.
KUBERNETES_SERVICE_IP = "10.96.0.1"
# The API server's names: the kubernetes Service's in-cluster DNS names, and the loopback address
# it listens on (istiod and the test kubelet reach it as 127.0.0.1).
APISERVER_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                   "kubernetes.default.svc.cluster.local")


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPKI:
    dir: Path
    ca: KeyPair
    apiserver: KeyPair  # serving certificate, also the API server's client cert to webhooks
    sa_key: Path  # service-account token signing key (controller-manager and API server)
    sa_pub: Path  # its public half (API server: --service-account-key-file)

    def authority(self) -> CertificateAuthority:
        return CertificateAuthority.load(self.ca.cert, self.ca.key)

    def issue(self, name: str, common_name: str, organizations: tuple[str, ...] = (),
              dns_names: tuple[str, ...] = (), ip_addresses: tuple[str, ...] = ()) -> KeyPair:
        """A certificate signed by the cluster CA, written as dir/name.crt and name.key."""
        cert_pem, key_pem = self.authority().issue_named_pem(common_name, organizations, dns_names, ip_addresses,
                                                              hours=24 * 30)
        pair = KeyPair(self.dir / f"{name}.crt", self.dir / f"{name}.key")
        pair.cert.write_bytes(cert_pem)
        write_private(pair.key, key_pem)
        return pair

    def kubeconfig(self, path: Path, server: str, user: str, client: KeyPair) -> Path:
        """A kubeconfig for `server` authenticating as `client`, every file embedded (copyable)."""
        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()

        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "meshcache", "cluster": {"server": server,
                                                           "certificate-authority-data": b64(self.ca.cert)}}],
            "users": [{"name": user, "user": {"client-certificate-data": b64(client.cert),
                                              "client-key-data": b64(client.key)}}],
            "contexts": [{"name": "meshcache", "context": {"cluster": "meshcache", "user": user}}],
            "current-context": "meshcache",
        }
        write_private(path, yaml.safe_dump(config, sort_keys=False).encode())
        return path


def create(directory: Path) -> ClusterPKI:
    """A fresh CA, the API server's serving certificate and the service-account key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = CertificateAuthority.create("meshcache local Kubernetes CA")
    ca_pair = KeyPair(directory / "ca.crt", directory / "ca.key")
    ca.save(ca_pair.cert, ca_pair.key)
    sa = ec.generate_private_key(ec.SECP256R1())
    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    write_private(sa_key, sa.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    sa_pub.write_bytes(sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    pki = ClusterPKI(directory, ca_pair, KeyPair(directory / "apiserver.crt", directory / "apiserver.key"),
                     sa_key, sa_pub)
    pki.issue("apiserver", "kube-apiserver", dns_names=APISERVER_NAMES,
              ip_addresses=("127.0.0.1", KUBERNETES_SERVICE_IP))
    return pki
