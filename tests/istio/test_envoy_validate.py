"""`envoy --mode validate` (Envoy 1.40) on every config in envoy/. The EnvoyFilters are validated
(and served) applied to an istiod-shaped sidecar config: tests/istio/test_sidecar.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshcache.contract.paths import ENVOY_CONFIG_DIR, envoy_binary, require_filter_native
from meshcache.ctl.pki import CertificateAuthority, spiffe_id

MODULE_IN_CONFIGS = "/etc/meshcache/meshcache_filter.wasm"
NATIVE_IN_CONFIGS = "/etc/meshcache/libmeshcache_native.so"  # Envoy loads the module to validate
CERTS_IN_CONFIGS = re.compile(r"/etc/meshcache/certs/([A-Za-z0-9_-]+)\.(crt|key)")
_ENVOY = "type.googleapis.com/envoy."


def envoy_validate(config: dict[str, Any] | str, tmp_path: Path,
                   name: str = "envoy.yaml", log_level: str = "error") -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", log_level],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("config", sorted(ENVOY_CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_envoy_configs_validate(config: Path, tmp_path: Path, filter_wasm: Path) -> None:
    text = config.read_text()
    if "envoy.extensions.filters.http.wasm" in text:
        assert MODULE_IN_CONFIGS in text, "the committed configs name the module by its deployed path"
    if "dynamic_modules" in text:
        assert NATIVE_IN_CONFIGS in text, "the committed configs name the module by its deployed path"
        text = text.replace(NATIVE_IN_CONFIGS, str(require_filter_native()))
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
    # At warning level Envoy names every deprecated field it loads: our configs use none.
    result = envoy_validate(text, tmp_path, config.name, log_level="warning")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout
    assert "Deprecated field" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_envoy_configs_are_current(tmp_path: Path) -> None:
    """The committed configs are what the renderer gives today (they drift when a fragment changes)."""
    from meshcache.ctl.envoy_config import examples

    rendered = {p.name: p.read_text() for p in examples(tmp_path)}
    committed = {p.name: p.read_text() for p in ENVOY_CONFIG_DIR.glob("*.yaml")}
    assert rendered.keys() == committed.keys()
    stale = sorted(name for name in rendered if rendered[name] != committed[name])
    assert not stale, f"{stale} differ from the renderer: run `python -m meshcache.ctl.envoy_config envoy`"
