"""TLS between istiod and the control plane's xDS port: a CA and the server certificate.

istiod 1.30 implements one TLS mode for `xds://` config sources, SIMPLE: it checks the server's
chain against the CA it reads from `tlsSettings.credentialName` (a Secret in istio-system, key
`ca.crt`) and the server name against `subjectAltNames` (DNS names). It presents no client
certificate, so who may connect at all is the NetworkPolicy's job (istiod only).
"""

from __future__ import annotations

from pathlib import Path

from meshcache.ctl.pki import CertificateAuthority, spiffe_id

CONTROL_PLANE = "meshcache-control-plane"
SERVER_SECRET = "meshcache-cp-xds-tls"  # kubernetes.io/tls in the meshcache namespace
CA_SECRET = "meshcache-cp-xds-ca"  # in istio-system: istiod's configSources credentialName


def dns_names(namespace: str) -> tuple[str, ...]:
    """The names istiod may dial: the first is the one `subjectAltNames` and `sni` use."""
    return (f"{CONTROL_PLANE}.{namespace}.svc", f"{CONTROL_PLANE}.{namespace}.svc.cluster.local")


def issue(namespace: str, out_dir: Path, days: int = 365) -> list[Path]:
    """ca.crt/ca.key and tls.crt/tls.key (0600 keys) for the control plane of `namespace`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ca = CertificateAuthority.create(name=f"meshcache xDS CA ({namespace})", days=days)
    ca.save(out_dir / "ca.crt", out_dir / "ca.key")
    ident = ca.issue(spiffe_id(namespace, CONTROL_PLANE), out_dir, "tls", hours=24.0 * days,
                     dns_names=dns_names(namespace))
    return [out_dir / "ca.crt", out_dir / "ca.key", ident.cert, ident.key]


def kubectl_commands(namespace: str, out_dir: Path) -> str:
    return (f"kubectl -n {namespace} create secret tls {SERVER_SECRET} "
            f"--cert={out_dir}/tls.crt --key={out_dir}/tls.key\n"
            f"kubectl -n istio-system create secret generic {CA_SECRET} --from-file=ca.crt={out_dir}/ca.crt")
