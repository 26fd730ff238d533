"""`meshcache istio render --filter`: which host of the cache core the sidecars run, and which
Istio versions can run it.

`wasm` (the default) is the proxy-wasm filter every Istio loads. `native` is the Envoy dynamic
module (filter/native/), which needs `envoy.filters.http.dynamic_modules` in istio-proxy: Istio's
proxy links it from release 1.31 (Envoy 1.39) on; release 1.30 (Envoy 1.38) does not
(istio/proxy `bazel/extension_config/extensions_build_config.bzl` per release branch).
"""

from __future__ import annotations

import re

FILTERS = ("wasm", "native")
# The Istio the manifests are written and validated for (../shared/istio/istio-1.30.3-crds.yaml).
ISTIO_VERSION = "1.30.3"
NATIVE_SINCE = (1, 31)
# The Envoy each istio-proxy release is built on, and the module build for its dynamic-module ABI
# (filter/dist/, filter/native/DESIGN.md "Envoy 1.39 and 1.40"), where one exists.
ISTIO_ENVOY = {(1, 30): "1.38", (1, 31): "1.39"}
NATIVE_MODULE_FOR_ENVOY = {"1.39": "libmeshcache_native-envoy-1.39.so", "1.40": "libmeshcache_native.so"}
VERSION_RE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(?:-[0-9A-Za-z.-]+)?")


def minor(istio_version: str) -> tuple[int, int]:
    """`--istio-version` (1.31, 1.31.0 or 1.31.0-beta.1) as (major, minor); ValueError otherwise."""
    m = VERSION_RE.fullmatch(istio_version.strip())
    if not m:
        raise ValueError(f"--istio-version {istio_version!r}: expected MAJOR.MINOR[.PATCH], e.g. 1.31.0")
    return int(m.group(1)), int(m.group(2))


def native_module_file(istio_version: str) -> str:
    """The module build (a file name in filter/dist/) whose dynamic-module ABI is that of Istio
    `istio_version`'s Envoy; ValueError, saying why, when there is none."""
    version = minor(istio_version)
    if version < NATIVE_SINCE:
        envoy = ISTIO_ENVOY.get(version)
        built_on = f" (built on Envoy {envoy})" if envoy else ""
        raise ValueError(
            f"--filter native needs Istio {NATIVE_SINCE[0]}.{NATIVE_SINCE[1]} or later: the istio-proxy of "
            f"Istio {istio_version}{built_on} does not link envoy.filters.http.dynamic_modules, so its sidecars "
            f"cannot load the module; use --filter wasm (the default) with this Istio, or give "
            f"--istio-version {NATIVE_SINCE[0]}.{NATIVE_SINCE[1]} or later")
    envoy = ISTIO_ENVOY.get(version)
    if envoy not in NATIVE_MODULE_FOR_ENVOY:
        known = ", ".join(f"{m}.{n}" for (m, n), e in sorted(ISTIO_ENVOY.items()) if e in NATIVE_MODULE_FOR_ENVOY)
        raise ValueError(
            f"--filter native for Istio {istio_version}: which Envoy its istio-proxy is built on is not known "
            f"here, and a module only loads in the Envoy whose dynamic-module ABI it was built for "
            f"(filter/native/DESIGN.md); native is rendered for Istio {known}")
    return NATIVE_MODULE_FOR_ENVOY[envoy]


def check(filter_host: str, istio_version: str) -> None:
    """ValueError, saying why, when `filter_host` cannot run in Istio `istio_version`'s sidecars."""
    if filter_host not in FILTERS:
        raise ValueError(f"--filter {filter_host!r}: use one of {', '.join(FILTERS)}")
    minor(istio_version)
    if filter_host == "native":
        native_module_file(istio_version)
