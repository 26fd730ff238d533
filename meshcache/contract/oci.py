"""The filter module as an OCI image, built deterministically so its digest is known offline.

Why an image and why its digest matters:
- For `oci://` URLs Istio checks a WasmPlugin's `sha256` against the *image manifest digest*
  (istio pkg/wasm: the fetcher's digest, or the `@sha256:` in the URL), not the .wasm file's
  hash. So the manifests pin the manifest digest, and that digest is a pure function of the
  module bytes here: same module, same image, same digest (fixed tar metadata, gzip mtime 0).
- The layout is Istio's "compat" variant (a regular single-layer image holding `plugin.wasm`),
  which istio-agent extracts and which the kubelet can also mount as an image volume: the
  internal stub listener (EnvoyFilter) loads the same bytes from that mount.

`write_layout(DIR)` writes an OCI image layout; push it unchanged (digest preserved) with e.g.
`oras cp --from-oci-layout DIR:TAG REGISTRY/REPO:TAG` or `skopeo copy oci:DIR:TAG docker://...`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

WASM_FILE_IN_IMAGE = "plugin.wasm"  # the name Istio's compat extractor looks for
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Image:
    module_sha256: str
    layer: bytes  # gzip'd tar holding plugin.wasm
    config: bytes
    manifest: bytes

    @property
    def digest(self) -> str:
        """Manifest digest (hex): what `sha256` and `@sha256:` must carry for oci:// URLs."""
        return sha256_hex(self.manifest)


def build_image(module: bytes) -> Image:
    """The Wasm filter's image: the module as plugin.wasm, its sha256 in the config's labels."""
    layer, config, manifest = image_parts({WASM_FILE_IN_IMAGE: module}, labels={
        "org.opencontainers.image.title": "meshcache-filter", "io.meshcache.module.sha256": sha256_hex(module)})
    return Image(module_sha256=sha256_hex(module), layer=layer, config=config, manifest=manifest)


def image_parts(files: dict[str, bytes], labels: dict[str, str] | None = None) -> tuple[bytes, bytes, bytes]:
    """A deterministic one-layer image holding `files` (path in the image -> content, read-only,
    root-owned, mtime 0): its gzip'd layer, config and manifest, so equal files give an equal digest."""
    tar_buf = io.BytesIO()
    with tarfile.open(fileobj=tar_buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o444, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    raw = tar_buf.getvalue()
    gz_buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=gz_buf, mtime=0, compresslevel=9) as gz:
        gz.write(raw)
    layer = gz_buf.getvalue()
    config = _canonical({
        "architecture": "amd64", "os": "linux",
        **({"config": {"Labels": labels}} if labels else {}),
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha256_hex(raw)}"]},
    })
    manifest = _canonical({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": f"sha256:{sha256_hex(config)}", "size": len(config)},
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": f"sha256:{sha256_hex(layer)}", "size": len(layer)}],
    })
    return layer, config, manifest


def image_for(module_path: Path) -> Image:
    return build_image(Path(module_path).read_bytes())


def extract_module(image: Image) -> bytes:
    """The wasm bytes as Istio's compat extractor would find them (used by the tests)."""
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(image.layer))) as tar:
        member = tar.extractfile(WASM_FILE_IN_IMAGE)
        if member is None:
            raise ValueError(f"{WASM_FILE_IN_IMAGE} missing from the image layer")
        return member.read()


def write_layout(image: Image, out_dir: Path, tag: str = "latest") -> Path:
    """An OCI image layout (oci-layout, index.json, blobs/sha256/*) for `oras`/`skopeo` to push."""
    blobs = out_dir / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    for blob in (image.layer, image.config, image.manifest):
        (blobs / sha256_hex(blob)).write_bytes(blob)
    (out_dir / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": MANIFEST_MEDIA_TYPE, "digest": f"sha256:{image.digest}", "size": len(image.manifest),
        "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    (out_dir / "index.json").write_text(json.dumps(index, indent=2))
    return out_dir
