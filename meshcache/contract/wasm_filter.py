"""The Envoy Wasm filter config that runs the meshcache module (one definition for all users).

The static Envoy configs, the ECDS default_config and the control plane's ECDS pushes all build
the filter from here, so the VM config (vm_id, runtime, code) is byte-for-byte the same and Envoy
reuses the running VM (and its shared-data cache) when only the plugin configuration changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .filter_config import plugin_config_json

FILTER_NAME = "meshcache"  # HTTP filter name; also the ECDS resource name
# The client role's HTTP filter and ECDS resource (filter_config.client_plugin_config).
CLIENT_FILTER_NAME = "meshcache-client"
ROOT_ID = "meshcache"
VM_ID = "meshcache"
WASM_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"


def local_code(wasm_path: Path) -> dict[str, Any]:
    """`vm_config.code` for a module file Envoy reads itself."""
    return {"local": {"filename": str(wasm_path)}}


def remote_code(url: str, sha256: str) -> dict[str, Any]:
    """`vm_config.code` for a module istio-agent fetches: the agent downloads `url` (oci:// or
    https://), checks `sha256` (for oci:// the image manifest digest) and rewrites this to a local
    file before Envoy sees it (istio pkg/wasm convert.go). Shaped as istiod's own WasmPlugin code
    (the cluster is a placeholder Envoy never uses)."""
    return {"remote": {"http_uri": {"uri": url, "cluster": "_", "timeout": "30s"}, "sha256": sha256}}


def code_for(url: str, sha256: str) -> dict[str, Any]:
    """`vm_config.code` for a module URL: a `file://` URL is a file on the proxy's machine, which
    Envoy reads itself (what istiod makes of a TrafficExtension's `file://` URL, and what
    istio-agent hands Envoy after fetching a remote one); anything else is `remote_code`. The
    local mesh with a real istiod uses `file://`, having no registry and no istio-agent."""
    if url.startswith("file://"):
        return local_code(Path(url.removeprefix("file://")))
    return remote_code(url, sha256)


def wasm_filter_config(
    wasm_path: Path | dict[str, Any], plugin_config: dict[str, Any], allow_on_headers_stop_iteration: bool = True
) -> dict[str, Any]:
    """`envoy.extensions.filters.http.wasm.v3.Wasm` as proto-JSON (without the @type).

    `wasm_path`: the module file, or a `vm_config.code` (`local_code`/`remote_code`).

    Without `allow_on_headers_stop_iteration` (as under Istio's WasmPlugin) the plugin
    configuration must say `"hold_headers": false`, or requests with a body would wait forever.
    """
    return wasm_filter_config_json(wasm_path, plugin_config_json(plugin_config), allow_on_headers_stop_iteration)


def wasm_filter_config_json(
    wasm_path: Path | dict[str, Any], config_json: str, allow_on_headers_stop_iteration: bool = True
) -> dict[str, Any]:
    """`wasm_filter_config` for a plugin configuration already in canonical JSON text
    (`filter_config.plugin_config_json`), e.g. a snapshot's: it is carried as is."""
    return {
        "config": {
            "name": FILTER_NAME,
            "root_id": ROOT_ID,
            "vm_config": {
                "vm_id": VM_ID,
                "runtime": "envoy.wasm.runtime.v8",
                "code": wasm_path if isinstance(wasm_path, dict) else local_code(wasm_path),
            },
            "configuration": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": config_json,
            },
            # Fail open: if the VM cannot run, traffic flows without the cache.
            "failure_policy": "FAIL_OPEN",
            # Lets the filter hold request headers and decide at end of body (before routing).
            "allow_on_headers_stop_iteration": allow_on_headers_stop_iteration,
        },
    }


def extension_config(code: dict[str, Any], plugin_config: dict[str, Any], name: str = FILTER_NAME) -> dict[str, Any]:
    """The filter as an ECDS resource (`envoy.config.core.v3.TypedExtensionConfig`, proto-JSON):
    what the control plane pushes to the local mesh's sidecars and what the full-mode EnvoyFilter's
    EXTENSION_CONFIG patch hands istiod. One builder, so both run the same Envoy config."""
    return extension_config_json(code, plugin_config_json(plugin_config), name)


def extension_config_json(code: dict[str, Any], config_json: str, name: str = FILTER_NAME) -> dict[str, Any]:
    """`extension_config` for a plugin configuration already in canonical JSON text (a snapshot's)."""
    return {"name": name, "typed_config": {"@type": WASM_TYPE_URL, **wasm_filter_config_json(code, config_json)}}


def ecds_http_filter(config_source: dict[str, Any], default_config: dict[str, Any] | None = None,
                     extra_type_urls: tuple[str, ...] = (), name: str = FILTER_NAME,
                     type_url: str = WASM_TYPE_URL, warm: bool = False) -> dict[str, Any]:
    """The `http_filters` entry that takes the filter from ECDS (`extension_config` by name).
    `type_url`: the filter type Envoy accepts for it (the Wasm filter's, or the dynamic module's).

    With a default config, Envoy never runs the filter without a config (a 500 for every
    request): the default applies until a config is accepted, and stays when the first one is
    refused. `warm=False`: the listener does not wait for the first config (traffic flows with
    the default before the first push); `warm=True`: it waits for the first answer, accepted or
    refused, as it does without a default (the default then only covers a refusal)."""
    discovery: dict[str, Any] = {"config_source": config_source, "type_urls": [type_url, *extra_type_urls]}
    if default_config is not None:
        discovery["default_config"] = default_config
        if not warm:
            discovery["apply_default_config_without_warming"] = True
    return {"name": name, "config_discovery": discovery}
