"""The native module's image (`render --filter native --native-image REPO@sha256:...`) as the test
kubelet runs it: the init container `meshcache-module` that render adds (istio/native_module.py)
with its real command (copy, sha256 check, chmod, rename into the emptyDir).

The image is emulated, as the kubelet emulates the project's other images (kubelet.py
RUNNABLE_IMAGES): its content layer is the module build at /meshcache/modules/<file>
(docs/istio.md's recipe), on the node's own /usr for the base (sh, cp, sha256sum: Debian, as the
recipe's base). Its digest is the manifest digest of that content layer as a deterministic OCI
image (`digest()`), so what render pins can be checked like a pull checks it: another digest is
not "in the registry" (ErrImagePull, the pod never starts). The container runs chrooted into a
read-only root built from it, as its securityContext's user, with the volume mounted where the
pod spec says: a wrong sha256 in its command fails it, and the pod stays in Init.

What it does not prove: that a real base image has the tools, or a registry's pull."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from meshcache.contract import oci
from meshcache.contract.paths import REPO_ROOT
from meshcache.ctl.istio.native_module import IMAGE_MODULE_DIR

Obj = dict[str, Any]
REPOSITORY = "registry.example.com/meshcache/filter-native"  # what the kube mesh renders as --native-image
DIST = REPO_ROOT / "filter" / "dist"  # the module builds the image holds (make filter)
MODULE_GLOB = "libmeshcache_native*.so"


def _modules() -> list[Path]:
    return sorted(DIST.glob(MODULE_GLOB))


def digest() -> str:
    """The emulated image's manifest digest: a deterministic image of its content layer (every
    module build under /meshcache/modules), so a new build is a new digest as with a real image."""
    files = {f"{IMAGE_MODULE_DIR.lstrip('/')}/{m.name}": m.read_bytes() for m in _modules()}
    return oci.sha256_hex(oci.image_parts(files)[2])


def reference() -> str:
    """REPOSITORY@sha256:<digest()>: what render pins for the kube mesh."""
    return f"{REPOSITORY}@sha256:{digest()}"


def is_module_image(image: str) -> bool:
    name = image.split("@", 1)[0]
    return REPOSITORY in (name, name.rsplit(":", 1)[0])


def pull_error(image: str) -> str | None:
    """Why a pull of `image` fails, or None: only the digest the emulated image has exists."""
    if "@sha256:" not in image:
        return f"{image}: the test kubelet pulls the module image by digest only"
    if image.rsplit("@sha256:", 1)[1] != digest():
        return f"{image}: manifest unknown (the image's digest is sha256:{digest()})"
    return None


def rootfs(root: Path) -> Path:
    """The image's root filesystem under `root`: its content layer (the module builds) and the
    mount points the container needs (/usr from the node for the base's tools)."""
    modules = root / IMAGE_MODULE_DIR.lstrip("/")
    modules.mkdir(parents=True, exist_ok=True)
    for module in _modules():
        target = modules / module.name
        shutil.copyfile(module, target)
        target.chmod(0o444)
    (root / "usr").mkdir(exist_ok=True)
    for merged in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr
        link = root / merged
        if not link.is_symlink() and (Path("/usr") / merged).exists():
            link.symlink_to(f"usr/{merged}")
    (root / "tmp").mkdir(exist_ok=True)
    return root


def run_argv(root: Path, mounts: dict[str, Path], user: int, group: int, command: list[str]) -> list[str]:
    """argv (to run in the pod's namespaces: its own mount namespace) of `command` chrooted into
    the read-only `root`, the node's /usr read-only under it, each volume (mount path -> the pod's
    volume directory) mounted read-write, as `user`:`group` (chroot --userspec)."""
    binds = ['mount --bind "$0" "$0"', 'mount -o remount,bind,ro "$0"',
             'mount --bind /usr "$0/usr"', 'mount -o remount,bind,ro "$0/usr"']
    args: list[str] = [str(root)]
    for k, (path, directory) in enumerate(sorted(mounts.items()), start=1):
        (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)  # the mount point, before ro
        binds.append(f'mount --bind "${k}" "$0{path}"')
        args.append(str(directory))
    script = " && ".join([*binds, f'shift {len(mounts)}', 'exec "$@"'])
    return ["sh", "-c", script, *args, "chroot", f"--userspec={user}:{group}", str(root), *command]
