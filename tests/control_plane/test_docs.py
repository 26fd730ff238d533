"""/docs and /redoc work offline: every asset the pages load is served by the control plane itself."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from meshcache.control_plane.api.docs import ASSET_FILES, assets_dir
from tests.helpers.control_plane import ControlPlaneProc

# Anything that names a host: scheme URLs and protocol-relative ones.
OUTSIDE = re.compile(r"(?i)\b(?:https?:)?//[a-z0-9.-]+")


class _Refs(HTMLParser):
    """src/href attributes of the page, and the text of its inline scripts."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [v for k, v in attrs if k in ("src", "href", "spec-url") and v]
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)


@pytest.mark.parametrize("page,expected_assets", [
    ("/docs", {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/docs/assets/favicon.png"}),
    ("/redoc", {"/docs/assets/redoc.standalone.js", "/docs/assets/favicon.png", "/openapi.json"}),
])
def test_docs_pages_load_only_local_assets(module_cp: ControlPlaneProc, page: str, expected_assets: set[str]
                                           ) -> None:
    with module_cp.client(None) as c:
        r = c.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        # The browser may load from this origin only (ReDoc's bundle would fetch a logo elsewhere).
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert "http" not in r.headers["content-security-policy"]
        assert not OUTSIDE.search(r.text), OUTSIDE.findall(r.text)  # no CDN, no fonts, no validator
        parser = _Refs()
        parser.feed(r.text)
        assert set(parser.refs) == expected_assets
        if page == "/docs":
            inline = "\n".join(parser.scripts)
            assert "url: '/openapi.json'" in inline and '"validatorUrl": null' in inline
        for ref in parser.refs:
            asset = c.get(ref)
            assert asset.status_code == 200, ref
            name = ref.rpartition("/")[2]
            if name in ASSET_FILES:  # byte for byte the packaged build
                assert asset.content == (assets_dir() / name).read_bytes(), ref
        assert c.get("/docs/assets/swagger-ui-bundle.js").headers["content-type"].split(";")[0] in (
            "text/javascript", "application/javascript")
        assert c.get("/docs/assets/../api.py").status_code == 404  # nothing else is served from there


def test_swagger_bundle_is_the_real_thing() -> None:
    # A stand-in file would render nothing: the build defines the globals the page calls.
    bundle = (assets_dir() / "swagger-ui-bundle.js").read_text(errors="replace")
    assert len(bundle) > 500_000 and "SwaggerUIBundle" in bundle
    redoc = (assets_dir() / "redoc.standalone.js").read_text(errors="replace")
    assert len(redoc) > 500_000 and "Redoc" in redoc


# ---- in a real browser -------------------------------------------------------------------------

def _browse(url: str, tmp_path: Path) -> tuple[str, list[str]]:
    """Headless Chromium with every outside host made unresolvable: the rendered DOM, and the URLs
    the page requested (its own network partition; Chromium's background requests live elsewhere)."""
    chromium = shutil.which("chromium")
    assert chromium, "chromium not found: scripts/setup.sh installs Debian's chromium"
    netlog = tmp_path / "netlog.json"
    out = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-features=AutofillServerCommunication",
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
         f"--log-net-log={netlog}", "--virtual-time-budget=20000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    log = json.loads(netlog.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    page_site = "http://127.0.0.1"
    jobs = [e.get("params", {}) for e in log["events"] if e["type"] == start_job]  # END events carry none
    requested = [p["url"] for p in jobs if "url" in p and str(p.get("network_isolation_key", "")).startswith(page_site)]
    return out.stdout, requested


@pytest.mark.parametrize("page,assets,rendered", [
    ("/docs", {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/openapi.json"},
     ['class="opblock-summary-path" data-path="/v1/policies"', 'data-path="/v1/purge"']),
    ("/redoc", {"/docs/assets/redoc.standalone.js", "/openapi.json"},
     ["meshcache control plane", "/v1/policies/{model_prefix}"]),
])
def test_docs_render_in_a_browser_without_the_internet(module_cp: ControlPlaneProc, tmp_path: Path, page: str,
                                                       assets: set[str], rendered: list[str]) -> None:
    dom, requested = _browse(module_cp.url + page, tmp_path)
    hosts = {urlsplit(u).netloc for u in requested}
    assert hosts == {f"127.0.0.1:{module_cp.http_port}"}, requested  # nothing from anywhere else
    assert assets <= {urlsplit(u).path for u in requested}, requested
    for text in rendered:  # the UI ran: it fetched the schema and drew the operations
        assert text in dom, (text, dom[:2000])
