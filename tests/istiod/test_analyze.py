"""`istioctl analyze --use-kube=false -A` (the istioctl built with istiod) over the rendered
manifests of the base and every overlay, with what the control plane serves istiod over MCP for
them and the rendered mesh config: nothing but the explained messages."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from meshcache.ctl.istio import kustomize, render
from meshcache.ctl.istiod import binary
from tests.istio.helpers import KUSTOMIZATIONS
from tests.istiod.helpers import require_istiod

# code -> why it is expected (docs/istio.md "Running against a real istiod").
EXPLAINED = {
    # Full mode's EnvoyFilters are Envoy-version specific by nature: the price of the exact Wasm
    # config (vm_id, held headers) and the gRPC hit route, which no other Istio API can express.
    "IST0133": lambda m: m["origin"].startswith("EnvoyFilter ") and "EnvoyFilter exposes internal" in m["message"],
}


def _analyze(opts: render.RenderOptions, tmp_path: Path) -> list[dict]:
    """`istioctl analyze` (offline) over what render writes for `opts`: its messages."""
    objects = render.render(opts)
    operators = render.render_operators(opts)
    files = render.write(objects, operators, render.mcp_objects(objects, render.demo_plugin_config()), tmp_path)
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(yaml.safe_dump(operators[1]["spec"]["meshConfig"]))
    manifests = [f for f in files if f.name in ("meshcache-istio.yaml", "mcp-preview.yaml")]
    done = subprocess.run([str(binary.require("istioctl")), "analyze", "--use-kube=false", "-A", "-o", "json",
                           f"--meshConfigFile={mesh}", *map(str, manifests)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout or "[]")


@pytest.mark.parametrize("source", KUSTOMIZATIONS, ids=[p.name for p in KUSTOMIZATIONS])
def test_istioctl_analyze_finds_nothing_unexplained(source: Path, tmp_path: Path) -> None:
    require_istiod()
    # Colours are meshcache's own engine's; the overlays in front of the user's servers have none.
    own = render.own_engine(kustomize.build(source))
    opts = (render.RenderOptions(source=source, color="green", also_colors=("blue",)) if own
            else render.RenderOptions(source=source))
    messages = _analyze(opts, tmp_path)
    unexplained = [m for m in messages if not EXPLAINED.get(m["code"], lambda _: False)(m)]
    assert not unexplained, json.dumps(unexplained, indent=1)
    if opts.source.name != "basic":
        assert {m["code"] for m in messages} == {"IST0133"}, "the EnvoyFilters were analyzed"


def test_istioctl_analyze_the_native_render(tmp_path: Path) -> None:
    """`render --filter native` for Istio 1.31: istioctl builds the DynamicModuleFilter patches
    as Envoy protos (its go-control-plane has the type) and finds nothing unexplained."""
    require_istiod()
    opts = render.RenderOptions(color="green", also_colors=("blue",), filter_host="native", istio_version="1.31",
                                native_image="registry.example.com/meshcache/filter-native@sha256:" + "ab" * 32)
    messages = _analyze(opts, tmp_path)
    assert {m["code"] for m in messages} == {"IST0133"}, json.dumps(messages, indent=1)
    assert "DynamicModuleFilter" in (tmp_path / "mcp-preview.yaml").read_text()
