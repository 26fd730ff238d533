"""Publishing the filter module as docs/istio.md says: `meshcache istio oci-layout`, then
`skopeo copy oci:LAYOUT:TAG docker://REGISTRY/...` to a real OCI registry (Debian's
docker-registry, the CNCF distribution registry, on a loopback port). The registry serves the
very manifest whose digest `render` pins, and istio-agent's pull by that digest (manifest, then
the layer) gives back the built module."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshcache.contract import oci
from meshcache.ctl.cli import main
from meshcache.ctl.istio import render, validate
from meshcache.ctl.procs import free_port, http_ok, local_http, start_ready, supervised


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("docker-registry")
    assert binary, "docker-registry is missing: `make setup` installs it (Debian package)"
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "registry")}},
        "http": {"addr": f"127.0.0.1:{port}"}}))
    with supervised([]) as procs:
        procs.append(start_ready("registry", [binary, "serve", str(config)], tmp_path / "logs",
                                 [(http_ok(f"http://127.0.0.1:{port}/v2/"), 20.0, "serving /v2/")]))
        yield f"127.0.0.1:{port}"


def _skopeo(*args: str) -> str:
    result = subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_publish_with_skopeo_and_pull_by_the_pinned_digest(tmp_path: Path, registry: str, filter_wasm: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    layout = tmp_path / "oci"
    assert main(["istio", "oci-layout", "--module", str(filter_wasm), "--out", str(layout), "--tag", "v0.1.0"]) == 0
    printed = capsys.readouterr().out
    digest = oci.image_for(filter_wasm).digest
    assert f"sha256:{digest}" in printed

    repo = f"{registry}/meshcache/filter"
    _skopeo("copy", "--preserve-digests", "--dest-tls-verify=false", f"oci:{layout}:v0.1.0", f"docker://{repo}:v0.1.0")
    # What the docs have the user run to check the pin: the tag resolves to the same manifest.
    raw = _skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{repo}:v0.1.0").encode()
    assert hashlib.sha256(raw).hexdigest() == digest

    # istio-agent pulls oci://REPO@sha256:DIGEST: the manifest by digest, then its one layer.
    base = f"http://{registry}/v2/meshcache/filter"
    manifest = local_http().get(f"{base}/manifests/sha256:{digest}", headers={"Accept": oci.MANIFEST_MEDIA_TYPE},
                                timeout=10)
    assert manifest.status_code == 200 and hashlib.sha256(manifest.content).hexdigest() == digest
    [layer] = manifest.json()["layers"]
    blob = local_http().get(f"{base}/blobs/{layer['digest']}", timeout=10, follow_redirects=True)
    assert f"sha256:{hashlib.sha256(blob.content).hexdigest()}" == layer["digest"]
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob.content))) as tar:
        member = tar.extractfile("plugin.wasm")
        assert member is not None and member.read() == filter_wasm.read_bytes()

    # The render for that registry pins the same digest.
    out = tmp_path / "rendered"
    assert main(["istio", "render", "--module", str(filter_wasm), "--filter-repository", repo,
                 "--out", str(out)]) == 0
    env = render.control_plane_env(validate.load_yaml_objects(out / "meshcache-istio.yaml"))
    assert env["MESHCACHE_CP_ISTIO_WASM_URL"] == f"oci://{repo}@sha256:{digest}"
    assert env["MESHCACHE_CP_ISTIO_WASM_SHA256"] == digest
