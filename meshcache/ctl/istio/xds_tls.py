"""TLS between istiod and the control plane's xDS port: a CA and the server certificate.

istiod 1.30 implements one TLS mode for `xds://` config sources, SIMPLE: it checks the server's
chain against the CA it reads from `tlsSettings.credentialName` (a Secret in istio-system, key
`ca.crt`) and the server name against `subjectAltNames` (DNS names). It presents no client
certificate, so who may connect at all is the NetworkPolicy's job (istiod only). It reads that
Secret once, when it starts (pilot/pkg/bootstrap/configcontroller.go `getTransportCredentials`):
a new CA reaches istiod by a restart, so a CA rotation goes through a bundle of both CAs.

Files in the output directory:
  ca.crt, ca.key       the CA that signs the server certificate; reused on every run unless
                       `new_ca` (the key never leaves this directory)
  ca-previous.crt      the CA before the last `new_ca`, until `drop_old_ca`
  ca-bundle.crt        what istiod trusts (the Secret's `ca.crt`): ca.crt, plus ca-previous.crt
                       while a rotation is under way
  tls.crt, tls.key     the control plane's server certificate (re-issued on every run but
                       `drop_old_ca`; the control plane re-reads it without a restart)
"""

from __future__ import annotations

import datetime as dt
import secrets
from pathlib import Path

from meshcache.ctl.pki import CertificateAuthority, spiffe_id

CONTROL_PLANE = "meshcache-control-plane"
SERVER_SECRET = "meshcache-cp-xds-tls"  # kubernetes.io/tls in the meshcache namespace
CA_SECRET = "meshcache-cp-xds-ca"  # in istio-system: istiod's configSources credentialName
CA, CA_KEY, PREVIOUS, BUNDLE = "ca.crt", "ca.key", "ca-previous.crt", "ca-bundle.crt"


def dns_names(namespace: str) -> tuple[str, ...]:
    """The names istiod may dial: the first is the one `subjectAltNames` and `sni` use."""
    return (f"{CONTROL_PLANE}.{namespace}.svc", f"{CONTROL_PLANE}.{namespace}.svc.cluster.local")


def _write_bundle(out_dir: Path) -> Path:
    parts = [out_dir / CA] + ([out_dir / PREVIOUS] if (out_dir / PREVIOUS).exists() else [])
    bundle = out_dir / BUNDLE
    bundle.write_bytes(b"".join(p.read_bytes() for p in parts))
    return bundle


def _ca(namespace: str, out_dir: Path, days: int, new_ca: bool) -> tuple[CertificateAuthority, list[Path]]:
    """The CA to sign with, and the CA files written (none when the existing one is reused)."""
    cert, key = out_dir / CA, out_dir / CA_KEY
    if cert.exists() and key.exists() and not new_ca:
        return CertificateAuthority.load(cert, key), []
    if cert.exists() and not new_ca:
        raise ValueError(f"{cert} exists without {key}: pass --new-ca to start a new CA (and rotate)")
    written = []
    if cert.exists():
        if (out_dir / PREVIOUS).exists():
            raise ValueError(f"a rotation is still under way ({out_dir / PREVIOUS} is in the bundle): finish it "
                             "with --drop-old-ca before starting another")
        cert.replace(out_dir / PREVIOUS)  # stays trusted (bundle) until --drop-old-ca
        key.unlink(missing_ok=True)
        written.append(out_dir / PREVIOUS)
    # A name of its own: verifiers pick the issuer by name, and BoringSSL (gRPC's) does not try a
    # second CA of the same name in a bundle; the date tells the two apart for people too.
    issued = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%MZ")
    ca = CertificateAuthority.create(name=f"meshcache xDS CA ({namespace}) {issued} {secrets.token_hex(3)}",
                                     days=days)
    ca.save(cert, key)
    return ca, [cert, key, *written]


def issue(namespace: str, out_dir: Path, days: int = 365, new_ca: bool = False) -> list[Path]:
    """The server certificate (tls.crt/tls.key, 0600 key) for the control plane of `namespace`,
    signed by the directory's CA: the existing one, or a new one (`new_ca`, or none yet). With
    `new_ca` the old CA stays in ca-bundle.crt (ca-previous.crt) until `drop_old_ca`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ca, written = _ca(namespace, out_dir, days, new_ca)
    ident = ca.issue(spiffe_id(namespace, CONTROL_PLANE), out_dir, "tls", hours=24.0 * days,
                     dns_names=dns_names(namespace))
    return [*written, _write_bundle(out_dir), ident.cert, ident.key]


def drop_old_ca(out_dir: Path) -> list[Path]:
    """The end of a rotation: ca-bundle.crt holds the current CA only."""
    if not (out_dir / CA).exists():
        raise ValueError(f"no CA in {out_dir}")
    (out_dir / PREVIOUS).unlink(missing_ok=True)
    return [_write_bundle(out_dir)]


def _apply(cmd: str) -> str:
    """`kubectl create` that also replaces an existing object (kubectl apply of its YAML)."""
    return f"{cmd} --dry-run=client -o yaml | kubectl apply -f -"


def kubectl_commands(namespace: str, out_dir: Path, stage: str = "first") -> str:
    """What to run after `issue`/`drop_old_ca`: `first` (nothing installed yet), `renew` (same
    CA: the server Secret only), `rotate` (a new CA: the bundle to istiod first, then the server
    certificate), `drop` (the bundle without the old CA)."""
    server = _apply(f"kubectl -n {namespace} create secret tls {SERVER_SECRET} "
                    f"--cert={out_dir}/tls.crt --key={out_dir}/tls.key")
    bundle = _apply(f"kubectl -n istio-system create secret generic {CA_SECRET} "
                    f"--from-file=ca.crt={out_dir}/{BUNDLE}")
    restart = ("kubectl -n istio-system rollout restart deployment/istiod && "
               "kubectl -n istio-system rollout status deployment/istiod")
    if stage == "first":
        return f"{server}\n{bundle}"
    if stage == "renew":
        return (f"# same CA: istiod already trusts it; the control plane re-reads its Secret (no restart)\n{server}")
    if stage == "rotate":
        return ("# 1. istiod trusts both CAs (it reads the Secret at start: restart it)\n"
                f"{bundle}\n{restart}\n"
                "# 2. only then the new server certificate (the control plane re-reads it, open streams stay)\n"
                f"{server}\n"
                f"# 3. once every control-plane pod serves it: meshcache istio xds-certs --out {out_dir} "
                "--namespace " + namespace + " --drop-old-ca")
    return f"# istiod trusts the new CA only from its next start\n{bundle}\n{restart}"
