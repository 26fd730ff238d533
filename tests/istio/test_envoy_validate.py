"""`envoy --mode validate` (Envoy 1.40) on every config in envoy/ and on the Envoy fragments of
the EnvoyFilters, assembled into a bootstrap the way a sidecar would hold them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshcache.envoy_config import BRIDGE
from meshcache.istio import envoyfilter
from meshcache.paths import ENVOY_CONFIG_DIR, envoy_binary
from meshcache.pki import CertificateAuthority, spiffe_id

MODULE_IN_CONFIGS = "/etc/meshcache/meshcache_filter.wasm"
CERTS_IN_CONFIGS = re.compile(r"/etc/meshcache/certs/([A-Za-z0-9_-]+)\.(crt|key)")
_ENVOY = "type.googleapis.com/envoy."


def envoy_validate(config: dict[str, Any] | str, tmp_path: Path,
                   name: str = "envoy.yaml") -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("config", sorted(ENVOY_CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_envoy_configs_validate(config: Path, tmp_path: Path, filter_wasm: Path) -> None:
    text = config.read_text()
    if "wasm" in text:
        assert MODULE_IN_CONFIGS in text, "the committed configs name the module by its deployed path"
    text = text.replace(MODULE_IN_CONFIGS, str(filter_wasm))
    # Certificates the configs expect at their deployed paths: a throwaway PKI with those names
    # (Envoy loads and parses them when it validates TLS contexts).
    ca = CertificateAuthority.create()
    certs = tmp_path / "certs"
    certs.mkdir()
    for name in {m.group(1) for m in CERTS_IN_CONFIGS.finditer(text)} - {"ca"}:
        ca.issue(spiffe_id("meshcache", name), certs, name)
    if CERTS_IN_CONFIGS.search(text):
        ca.save(certs / "ca.crt", certs / "ca.key")
    text = CERTS_IN_CONFIGS.sub(lambda m: str(certs / f"{m.group(1)}.{m.group(2)}"), text)
    result = envoy_validate(text, tmp_path, config.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def _cluster(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def sidecar_like_bootstrap(module: Path) -> dict[str, Any]:
    """The EnvoyFilter fragments where Istio would put them: the inbound HCM gets the cache filter
    (ECDS overlay form), the bridge and the hit route; the stub listener and clusters are added."""
    router = {"name": envoyfilter.ROUTER,
              "typed_config": {"@type": _ENVOY + "extensions.filters.http.router.v3.Router"}}
    inbound_routes = [envoyfilter.hit_route(),
                      {"name": "default", "match": {"prefix": "/"}, "route": {"cluster": "inbound|8001||"}}]
    hcm = {
        "@type": _ENVOY + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inbound_8001",
        "route_config": {"name": "inbound|8001||", "virtual_hosts": [
            {"name": "inbound|http|8001", "domains": ["*"], "routes": inbound_routes}]},
        "http_filters": [envoyfilter.ecds_cache_filter(module), envoyfilter.bridge_filter(), router],
    }
    listeners = [
        {"name": "virtualInbound", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 15006}},
         "filter_chains": [{"filters": [{"name": envoyfilter.HCM, "typed_config": hcm}]}]},
        envoyfilter.stub_listener(envoyfilter.ISTIO_VM_ID, module),
    ]
    sds = _cluster("sds-grpc", 15012)
    sds["typed_extension_protocol_options"] = envoyfilter.xds_cluster()["typed_extension_protocol_options"]
    return {
        "node": {"id": "sidecar~10.0.0.1~engine.meshcache~meshcache.svc.cluster.local", "cluster": "engine"},
        "static_resources": {"listeners": listeners, "clusters": [
            envoyfilter.stub_cluster(), envoyfilter.xds_cluster(), sds, _cluster("inbound|8001||", 8001)]},
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": _ENVOY + "extensions.bootstrap.internal_listener.v3.InternalListener"}}],
    }


def test_envoy_filter_fragments_validate(tmp_path: Path, filter_wasm: Path) -> None:
    result = envoy_validate(sidecar_like_bootstrap(filter_wasm), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_fragment_is_caught(tmp_path: Path, filter_wasm: Path) -> None:
    bootstrap = sidecar_like_bootstrap(filter_wasm)
    route = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"][0]
    route["typed_per_filter_config"][BRIDGE]["config"]["enabled"] = True  # no such field
    result = envoy_validate(bootstrap, tmp_path)
    assert result.returncode != 0 and "enabled" in result.stdout + result.stderr
