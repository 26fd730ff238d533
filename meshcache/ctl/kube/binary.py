"""Where the Kubernetes binaries are: built once per machine by scripts/build_kube.sh (`make
setup`), cached outside the work tree under the hash of scripts/kube/versions. (pilot-agent is
built with istiod: meshcache.ctl.istiod.binary.)"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from meshcache.contract.paths import REPO_ROOT

BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_kube.sh"
VERSIONS_FILE = REPO_ROOT / "scripts" / "kube" / "versions"


class KubeMissing(FileNotFoundError):
    pass


def versions() -> dict[str, str]:
    """The pins (KUBERNETES_VERSION, ETCD_VERSION, ...) from scripts/kube/versions."""
    pins = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            pins[name.strip()] = value.strip()
    return pins


@functools.cache
def bin_dir() -> Path:
    """The cache directory for the current pins (the script owns the key)."""
    out = subprocess.run([str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True, check=True, timeout=30)
    return Path(out.stdout.strip())


def require(name: str) -> Path:
    """The binary (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd), or
    KubeMissing with one line saying how to build it."""
    path = bin_dir() / name
    if not path.is_file():
        pin = versions()["KUBERNETES_VERSION"]
        raise KubeMissing(f"{path} is missing: the Kubernetes control plane is built by `make setup` "
                          f"(scripts/build_kube.sh, k8s.io/kubernetes@{pin}, needs Go 1.26)")
    return path
