"""The Grafana dashboard's queries against a real Prometheus scraping a live local mesh.

Prometheus (Debian's binary) runs deploy/prometheus/prometheus.yml with only the targets moved
to the test mesh's ports and a 1 s scrape interval. After some traffic every metric name the
dashboard uses must exist in what Prometheus scraped, and every panel query must return data.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshcache.contract.extensions import Workloads
from meshcache.contract.paths import REPO_ROOT
from meshcache.ctl import procs
from meshcache.ctl.istio import monitoring
from meshcache.ctl.procs import local_http
from tests.helpers.kserve import grpc_call, mlp_json, mlp_request, rest_infer
from tests.helpers.wait import eventually
from tests.status.helpers import RunningMesh
from tests.status.test_proxy_stats import LLM_PAGE

DEPLOY = REPO_ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "meshcache.json"
LOCAL_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
K8S_CONFIG = DEPLOY / "prometheus" / "kubernetes.yml"
pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus missing (scripts/setup.sh installs Debian's prometheus)")


# Panels of LLM traffic (docs/llm.md): tokens saved per policy and the semantic layer's counters.
# Their series exist only with a filter that counts them; where scraped, they must have data too.
LLM_PANELS = {"Tokens saved per model /s", "Semantic lookups /s"}


def _host_port(url: str) -> str:
    return re.sub(r"^https?://", "", url).split("/", 1)[0]


def dashboard_queries() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["query"]["query"]))
    return out


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bmeshcache_[a-z_]+\b", expr))


@pytest.fixture
def prometheus(running_mesh: RunningMesh, tmp_path: Path) -> Iterator[str]:
    e = running_mesh.endpoints
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    targets = {
        "meshcache-sidecars": [_host_port(e["server_sidecar_admin"])],
        "meshcache-control-plane": [_host_port(e["control_plane_api"])],
        "meshcache-engine": [_host_port(e["engine_metrics"]), _host_port(e["canary_engine_metrics"])],
    }
    for job in config["scrape_configs"]:
        wanted = targets.pop(job["job_name"])
        for group, target in zip(job["static_configs"], wanted, strict=True):
            group["targets"] = [target]
    assert not targets, f"jobs missing from {LOCAL_CONFIG}: {list(targets)}"
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs.start_ready(
        "prometheus",
        ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        tmp_path / "logs", [(procs.http_ok(f"{url}/-/ready"), 60, "ready")])
    try:
        yield url
    finally:
        proc.stop()


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    r = local_http().get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]  # type: ignore[no-any-return]


def test_every_dashboard_query_has_live_data(running_mesh: RunningMesh, prometheus: str) -> None:
    e = running_mesh.endpoints
    # Traffic that moves every series the dashboard shows: misses + hits (stored entries), a
    # bypass (Authorization), and an engine failure (wrong input shape).
    for seed in range(9101, 9104):
        request = mlp_request(seed).SerializeToString()
        grpc_call(e["app"], request)
        grpc_call(e["app"], request)
    credentials = rest_infer(e["app"], "mlp-classifier", mlp_json(9104), {"authorization": "Bearer x"})
    assert credentials.headers["cache-status"] == "meshcache; fwd=bypass; detail=credentials"
    no_store = rest_infer(e["app"], "mlp-classifier", mlp_json(9105), {"cache-control": "no-store"})
    assert no_store.headers["cache-status"] == "meshcache; fwd=bypass; detail=no-store"
    bad = {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    refused = rest_infer(e["engine_http"], "mlp-classifier", bad)
    assert refused.status_code == 400

    queries = dashboard_queries()
    assert len(queries) >= 20
    names = set().union(*(metric_names(q) for _, q in queries))
    deadline = time.monotonic() + 60
    missing: dict[str, str] = {}
    while time.monotonic() < deadline:
        live = set(local_http().get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"])
        missing = {}
        for title, expr in queries:
            concrete = expr.replace("$__rate_interval", "15s").replace("$model", ".*")
            absent = metric_names(expr) - live
            if absent and title in LLM_PANELS:
                _query(prometheus, concrete)  # valid PromQL; its series need a filter with the semantic layer
            elif absent:
                missing[title] = f"metrics not scraped: {sorted(absent)}"
            elif not title.startswith("variable") and not _query(prometheus, concrete):
                missing[title] = f"no data: {concrete}"
        if not missing:
            break
        time.sleep(1)
    assert not missing, json.dumps(missing, indent=1)
    assert {"meshcache_policy_hits", "meshcache_hits", "meshcache_cp_snapshot_version",
            "meshcache_engine_requests_total", "meshcache_policy_entries", "meshcache_policy_bytes",
            "meshcache_unattributed_entries", "meshcache_unattributed_bytes"} <= names

    # Entries per model (the relabelled gauges) plus the unattributed ones add up to the total.
    def adds_up(what: str) -> bool:
        parts = _query(prometheus, f"sum(meshcache_policy_{what}) + sum(meshcache_unattributed_{what})")
        total = _query(prometheus, f"sum(meshcache_{what})")
        return bool(parts and total) and float(parts[0]["value"][1]) == float(total[0]["value"][1]) > 0

    deadline = time.monotonic() + 20
    while not (adds_up("entries") and adds_up("bytes")) and time.monotonic() < deadline:
        time.sleep(1)
    assert adds_up("entries") and adds_up("bytes")
    stored = _query(prometheus, 'meshcache_policy_entries{model="mlp_classifier"}')
    assert stored and float(stored[0]["value"][1]) >= 3, stored

    # The model variable lists the policies' models (label set by the scrape config's relabelling).
    models = local_http().get(f"{prometheus}/api/v1/label/model/values",
                              params={"match[]": "meshcache_policy_hits"}, timeout=10).json()["data"]
    assert {"mlp_classifier", "resnet_mini", "text_embedder"} <= set(models)
    # The same prefix under the label that says what it is.
    policies = local_http().get(f"{prometheus}/api/v1/label/policy/values",
                                params={"match[]": "meshcache_policy_entries"}, timeout=10).json()["data"]
    assert set(policies) == set(local_http().get(f"{prometheus}/api/v1/label/model/values",
                                                 params={"match[]": "meshcache_policy_entries"},
                                                 timeout=10).json()["data"]) >= {"mlp_classifier"}, policies
    # One model label across filter and engine metrics: the engine's requests join the filter's
    # hits on `model` (the engine's own name is mlp-classifier; the scrape config rewrites it).
    engine_models = local_http().get(f"{prometheus}/api/v1/label/model/values",
                                     params={"match[]": "meshcache_engine_requests_total"}, timeout=10).json()["data"]
    assert "mlp_classifier" in engine_models and not [m for m in engine_models if "-" in m], engine_models
    joined = _query(prometheus, "sum by (model) (meshcache_engine_requests_total) and on (model) "
                                "sum by (model) (meshcache_policy_hits)")
    assert "mlp_classifier" in {r["metric"]["model"] for r in joined}, joined

    # Bypasses per reason, the label spelled as the Cache-Status detail (`no-store`, not `no_store`).
    reasons = {r["metric"]["reason"]: float(r["value"][1])
               for r in _query(prometheus, "sum by (reason) (meshcache_bypasses_by_reason)")}
    assert reasons["credentials"] >= 1 and reasons["no-store"] >= 1 and reasons["no-policy"] == 0, reasons
    assert not [r for r in reasons if "_" in r], reasons
    # The sidecar's own filter-config verdicts: it took the control plane's config and rejected none.
    verdicts = {(r["metric"]["__name__"], r["metric"]["filter"]): float(r["value"][1])
                for r in _query(prometheus, '{__name__=~"meshcache_config_(fail|reload)"}')}
    assert verdicts.get(("meshcache_config_reload", "meshcache"), 0) >= 1, verdicts
    assert verdicts.get(("meshcache_config_fail", "meshcache")) == 0, verdicts


def test_kubernetes_scrape_config_keeps_the_same_names() -> None:
    local = yaml.safe_load(LOCAL_CONFIG.read_text())
    k8s = yaml.safe_load(K8S_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in k8s["scrape_configs"]}
    assert set(jobs) == {j["job_name"] for j in local["scrape_configs"]}
    sidecars = next(j for j in local["scrape_configs"] if j["job_name"] == "meshcache-sidecars")
    assert jobs["meshcache-sidecars"]["metric_relabel_configs"] == sidecars["metric_relabel_configs"]
    # The same rules as the rendered PodMonitors (meshcache/ctl/istio/monitoring.py).
    assert sidecars["metric_relabel_configs"] == monitoring.filter_model_rules()
    engine = next(j for j in local["scrape_configs"] if j["job_name"] == "meshcache-engine")
    assert engine["metric_relabel_configs"] == jobs["meshcache-engine"]["metric_relabel_configs"] == \
        monitoring.server_model_rules()
    assert jobs["meshcache-sidecars"]["metrics_path"] == "/stats/prometheus"
    # The whole file is what `render` writes for the default selector (prometheus-kubernetes.yml).
    assert k8s["scrape_configs"] == monitoring.kubernetes_scrape_configs(Workloads(), own_engine=True)


def test_the_scrape_config_moves_the_policy_out_of_the_token_series(tmp_path: Path) -> None:
    """The sidecars job's relabelling (deploy/prometheus/prometheus.yml) on a real Prometheus
    scraping a page in Envoy's shape with the LLM series (tests/status/test_proxy_stats.py): the
    tokens saved per policy become meshcache_policy_tokens_saved_prompt|completion{policy, model},
    the semantic counters keep their names, and a prefix's `-` stays `_` as in the other series."""
    page = LLM_PAGE.encode()

    class Stats(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stats)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        config = yaml.safe_load(LOCAL_CONFIG.read_text())
        config["global"]["scrape_interval"] = "1s"
        sidecars = next(j for j in config["scrape_configs"] if j["job_name"] == "meshcache-sidecars")
        sidecars["static_configs"] = [{"targets": [f"127.0.0.1:{server.server_address[1]}"]}]
        config["scrape_configs"] = [sidecars]
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        port = procs.free_port()
        url = f"http://127.0.0.1:{port}"
        proc = procs.start_ready(
            "prometheus", ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                           f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            tmp_path / "logs", [(procs.http_ok(f"{url}/-/ready"), 60, "ready")])
        try:
            prompt = eventually(lambda: _query(url, "meshcache_policy_tokens_saved_prompt"), timeout=30)
            by_policy = {(r["metric"]["policy"], r["metric"]["model"]): float(r["value"][1]) for r in prompt}
            assert by_policy == {("llama3_", "llama3_"): 162.0, ("resnet_mini", "resnet_mini"): 0.0}, by_policy
            completion = _query(url, 'meshcache_policy_tokens_saved_completion{policy="llama3_"}')
            assert [float(r["value"][1]) for r in completion] == [72.0]
            assert _query(url, 'meshcache_policy_hits{policy="llama3_"}')[0]["value"][1] == "6"
            semantic = {r["metric"]["__name__"]: float(r["value"][1])
                        for r in _query(url, '{__name__=~"meshcache_semantic_.+"}')}
            assert semantic == {"meshcache_semantic_lookups": 9, "meshcache_semantic_hits": 2,
                                "meshcache_semantic_would_hit": 3, "meshcache_semantic_errors": 1}
            assert not _query(url, '{__name__=~"meshcache_policy_.+_tokens_saved_.+"}')  # none left unrelabelled
        finally:
            proc.stop()
    finally:
        server.shutdown()
        server.server_close()
