"""Where the patched istiod and istioctl are: built once per machine by scripts/build_istiod.sh
(`make setup`), cached outside the work tree under the pinned module version and patch hash."""

from __future__ import annotations

import subprocess
from pathlib import Path

from meshcache.contract.paths import REPO_ROOT

BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_istiod.sh"
MODULE_VERSION_FILE = REPO_ROOT / "scripts" / "istiod" / "module-version"


class IstiodMissing(FileNotFoundError):
    pass


def module_version() -> str:
    return MODULE_VERSION_FILE.read_text().strip()


def bin_dir() -> Path:
    """The cache directory for the current version and patches (the script owns the key)."""
    out = subprocess.run([str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True, check=True, timeout=30)
    return Path(out.stdout.strip())


def require(name: str = "pilot-discovery") -> Path:
    """The binary, or IstiodMissing with one line saying how to build it."""
    path = bin_dir() / name
    if not path.is_file():
        raise IstiodMissing(f"{path} is missing: istiod is built by `make setup` (scripts/build_istiod.sh, "
                            f"istio.io/istio@{module_version()}, needs Go 1.26)")
    return path
