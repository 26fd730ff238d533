"""`meshcache istio render --filter native`: how the dynamic module reaches an injected sidecar.

Envoy loads a dynamic module with dlopen, from a file on the proxy's filesystem; istio-agent
fetches Wasm modules only. The choice (docs/istio.md, "The native host under Istio 1.31"):

- **Not an image volume.** Kubernetes mounts `image` volumes read-only and `noexec`, and the
  loader cannot map a shared object's code from a noexec mount.
- **An init container copies it into an emptyDir** (`meshcache-module`) that istio-proxy mounts
  read-only through `sidecar.istio.io/userVolumeMount` (a JSON object keyed by the volume name,
  as Istio's injection template reads it; the volume itself is in the pod spec, so the API
  server validates the Deployment as written). The image is pinned by digest (`--native-image
  REPO@sha256:...`) and the copy is checked against the module's sha256 that render computed
  from the build: a wrong file fails the init container, so the pod never starts with it (and
  the sidecar never loads it).
- **`sidecar.istio.io/nativeSidecar: "false"`** on these pods: with Kubernetes native sidecars
  the injector puts istio-proxy before the pod's own init containers (istio
  `pkg/kube/inject/webhook.go`, "{istio-init/istio-validation} => proxy => rest"), so Envoy
  would take the filter config from istiod before the module is there and NACK it; as a
  classic sidecar, istio-proxy starts after every init container.
"""

from __future__ import annotations

import json
import re
from typing import Any

from meshcache.contract.extensions import NATIVE_MODULE_DIR

Obj = dict[str, Any]
VOLUME = "meshcache-module"
INIT_CONTAINER = "meshcache-module"
IMAGE_MODULE_DIR = "/meshcache/modules"  # where the module image holds the file
COPY_DIR = "/meshcache-module"  # the emptyDir, in the init container
SIZE_LIMIT = "64Mi"  # the module is ~7 MB; bounded like everything else
PINNED_IMAGE_RE = re.compile(r"^[a-z0-9]([-a-z0-9._:]*[a-z0-9])?(/[a-z0-9]([-a-z0-9._]*[a-z0-9])?)*"
                             r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[a-f0-9]{64}$")
SHA256_RE = re.compile(r"^[a-f0-9]{64}$")
MODULE_FILE_RE = re.compile(r"^lib[A-Za-z0-9_.-]+\.so$")


def check_image(image: str | None) -> str:
    if not image:
        raise ValueError("--filter native needs --native-image REPO@sha256:DIGEST: the image the init container "
                         f"copies the module from ({IMAGE_MODULE_DIR}/<module>, with sh, cp and sha256sum; "
                         "docs/istio.md, \"The native host under Istio 1.31\")")
    if not PINNED_IMAGE_RE.match(image):
        raise ValueError(f"--native-image {image!r} must be an image reference pinned by digest "
                         "(registry/repository[:tag]@sha256:<64 hex>)")
    return image


def sidecar_path(module_file: str) -> str:
    """The module's path in istio-proxy (what the EnvoyFilter's DynamicModuleFilter names)."""
    return f"{NATIVE_MODULE_DIR}/{module_file}"


def copy_command(module_file: str, sha256: str) -> list[str]:
    """Copy, then check the copy: the init container fails (and the pod waits) on a wrong file."""
    if not MODULE_FILE_RE.match(module_file) or not SHA256_RE.match(sha256):
        raise ValueError(f"module file {module_file!r} / sha256 {sha256!r}")
    src, dst = f"{IMAGE_MODULE_DIR}/{module_file}", f"{COPY_DIR}/{module_file}"
    return ["sh", "-c", f"set -e; cp {src} {dst}.tmp; echo '{sha256}  {dst}.tmp' | sha256sum -c -; "
                        f"chmod 0444 {dst}.tmp; mv {dst}.tmp {dst}"]


def add_to_pod_template(template: Obj, *, image: str, module_file: str, sha256: str) -> None:
    """The volume, the init container and the sidecar annotations, on a pod template."""
    spec, meta = template["spec"], template["metadata"]
    spec["volumes"] = [v for v in spec.get("volumes", []) if v["name"] != VOLUME] + [
        {"name": VOLUME, "emptyDir": {"sizeLimit": SIZE_LIMIT}}]
    init = {
        "name": INIT_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",  # pinned by digest: never stale
        "command": copy_command(module_file, sha256),
        "volumeMounts": [{"name": VOLUME, "mountPath": COPY_DIR}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        # istio-proxy's user (1337) reads the file (0444); this one only writes it.
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1337, "runAsGroup": 1337,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    spec["initContainers"] = [c for c in spec.get("initContainers", []) if c["name"] != INIT_CONTAINER] + [init]
    ann = meta.setdefault("annotations", {})
    mounts = json.loads(ann.get("sidecar.istio.io/userVolumeMount", "{}"))
    mounts[VOLUME] = {"mountPath": NATIVE_MODULE_DIR, "readOnly": True}
    ann["sidecar.istio.io/userVolumeMount"] = json.dumps(mounts, sort_keys=True)
    ann["sidecar.istio.io/nativeSidecar"] = "false"
