"""The filter's OCI registry for the test node: Debian's docker-registry (the CNCF distribution
registry) on the node address, port 443, TLS with a certificate for the rendered repository's
host (registry.example.com) from a throwaway CA, holding the built module's image as
`meshcache istio oci-layout` + `skopeo copy` publish it. Pods resolve that host to the node, and
the agents are told the registry is insecure (WASM_INSECURE_REGISTRIES: TLS without verifying
the certificate, as for a private registry without a public CA): the rendered
`oci://...@sha256:` URL is then fetched and its digest checked by istio-agent itself."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from meshcache.contract import oci
from meshcache.ctl import procs
from meshcache.ctl.istio import render
from meshcache.ctl.pki import CertificateAuthority, write_private

HOST = render.FILTER_REPOSITORY.split("/", 1)[0]  # registry.example.com
REPOSITORY = render.FILTER_REPOSITORY.split("/", 1)[1]  # meshcache/filter


def start_registry(address: str, module: Path, work: Path) -> procs.Proc:
    """docker-registry on address:443 with the module's image pushed (by digest and tag)."""
    binary = shutil.which("docker-registry")
    if not binary:
        raise procs.StartError("docker-registry is missing: `make setup` installs it (Debian package)")
    config = work / "registry.yml"
    work.mkdir(parents=True, exist_ok=True)
    cert_pem, key_pem = CertificateAuthority.create("meshcache test registry CA").issue_named_pem(
        HOST, dns_names=(HOST,), ip_addresses=(address,))
    (work / "tls.crt").write_bytes(cert_pem)
    write_private(work / "tls.key", key_pem)
    config.write_text(json.dumps({"version": 0.1, "log": {"level": "warn"},  # YAML is a superset of JSON
                                  "storage": {"filesystem": {"rootdirectory": str(work / "data")}},
                                  "http": {"addr": f"{address}:443", "tls": {"certificate": str(work / "tls.crt"),
                                                                             "key": str(work / "tls.key")}}}))
    proc = procs.start_ready("registry", [binary, "serve", str(config)], work / "logs",
                             [(lambda: procs.port_open(443, address), 20.0, "listening")])
    try:
        layout = oci.write_layout(oci.image_for(module), work / "layout", tag="v0.1.0")
        out = subprocess.run(["skopeo", "copy", "--preserve-digests", "--dest-tls-verify=false",
                              f"oci:{layout}:v0.1.0", f"docker://{address}:443/{REPOSITORY}:v0.1.0"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise procs.StartError(f"skopeo copy to the test registry failed: {out.stderr.strip()}")
    except BaseException:
        proc.stop()
        raise
    return proc
