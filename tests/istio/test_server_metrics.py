"""The user's servers' metrics under meshcache's `model` label: the `meshcache-servers` scrape
job `render` writes (prometheus-kubernetes.yml, and the PodMonitor of monitoring.yaml with the same
rules) run by a real Prometheus against a real KServe Python runtime (KServe's ModelServer) and a
page in Triton's exposition format, each standing where the Istio agent's merged :15020 page
would (Envoy's own stats on it too). Only the servers' metrics are kept, the model appears as
the filter's stat names spell it, and the Grafana panels for engines return their series."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshcache.contract.paths import REPO_ROOT
from meshcache.ctl import procs
from meshcache.ctl.istio import monitoring, render
from meshcache.ctl.procs import local_http
from tests.helpers.wait import eventually
from tests.istio.helpers import ISTIO_DIR

KSERVE_PYTHON = REPO_ROOT / ".venv-kserve" / "bin" / "python"
KSERVE_MODEL = Path(__file__).with_name("kserve_model.py")
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "meshcache.json"
# Triton's metrics (docs/user_guide/metrics.md of triton-inference-server/server: counters per
# model and version), with an Envoy stat and a Go runtime metric as the Istio agent merges them.
TRITON_PAGE = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="resnet-50.v1",version="1"} NUM
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="resnet-50.v1",reason="BACKEND",version="1"} FAIL
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="resnet-50.v1",version="1"} COUNT
# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="resnet-50.v1",version="1"} NUM
# TYPE envoy_server_live gauge
envoy_server_live{} 1
# TYPE go_goroutines gauge
go_goroutines 12
"""
pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus missing (scripts/setup.sh installs Debian's prometheus)")


def _servers_job(overlay: str) -> dict[str, Any]:
    objects = render.render(render.RenderOptions(source=ISTIO_DIR / "overlays" / overlay))
    job = next(j for j in render.scrape_configs(objects) if j["job_name"] == "meshcache-servers")
    # The PodMonitor carries the same rules (Prometheus Operator spelling).
    monitor = next(m for m in render.monitors(objects) if m["metadata"]["name"] == "meshcache-servers")
    assert monitor["spec"]["podMetricsEndpoints"][0]["metricRelabelings"] == monitoring.operator_rules(
        job["metric_relabel_configs"])
    assert monitor["spec"]["selector"]["matchLabels"] == render.workloads_from_env(
        render.control_plane_env(objects)).labels
    return job


def test_servers_job_follows_the_engine_selector() -> None:
    objects = render.render(render.RenderOptions(source=ISTIO_DIR / "overlays" / "triton",
                                                 engine_selector={"app": "tritonserver", "tier": "gpu"}))
    job = next(j for j in render.scrape_configs(objects) if j["job_name"] == "meshcache-servers")
    keeps = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keeps == {"__meta_kubernetes_pod_container_name": "istio-proxy",
                     "__meta_kubernetes_pod_label_app": "tritonserver", "__meta_kubernetes_pod_label_tier": "gpu"}
    monitor = next(m for m in render.monitors(objects) if m["metadata"]["name"] == "meshcache-servers")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app": "tritonserver", "tier": "gpu"}
    # The sidecar job reads the same merged page: it leaves the servers' metrics to their job.
    sidecars = next(j for j in render.scrape_configs(objects) if j["job_name"] == "meshcache-sidecars")
    assert sidecars["metric_relabel_configs"][0] == {"source_labels": ["__name__"],
                                                     "regex": monitoring.SERVER_METRICS, "action": "drop"}
    # meshcache's own engine: its own job, no servers job.
    own = render.render(render.RenderOptions())
    assert "meshcache-servers" not in {j["job_name"] for j in render.scrape_configs(own)}
    assert "meshcache-servers" not in {m["metadata"]["name"] for m in render.monitors(own)}


@pytest.fixture
def kserve(tmp_path: Path) -> Iterator[str]:
    if not KSERVE_PYTHON.exists():
        pytest.fail("KServe's SDK is missing: `make setup` makes .venv-kserve")
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs.start_ready("kserve", [str(KSERVE_PYTHON), str(KSERVE_MODEL), str(port), "sk-learn.iris"],
                             tmp_path / "logs", [(procs.http_ok(f"{url}/v1/models/sk-learn.iris"), 120, "ready")])
    try:
        yield url
    finally:
        proc.stop()


@pytest.fixture
def triton_page(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """Triton's page (the file, the port it is served on); the test rewrites it as counters move."""
    root = tmp_path / "triton"
    (root / "metrics").mkdir(parents=True)
    port = procs.free_port()
    proc = procs.start_ready("triton-page", ["python3", "-m", "http.server", "--bind", "127.0.0.1",
                                             "--directory", str(root), str(port)],
                             tmp_path / "logs", [(procs.tcp_open(port), 30, "listening")])
    try:
        yield root / "metrics" / "index.html", port
    finally:
        proc.stop()


def _write_triton(path: Path, n: int) -> None:
    path.write_text(TRITON_PAGE.replace("NUM", str(10 * n)).replace("FAIL", str(n))
                          .replace("COUNT", str(40 * n)))


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    body = local_http().get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]  # type: ignore[no-any-return]


def test_servers_metrics_get_the_model_label(tmp_path: Path, kserve: str,
                                             triton_page: tuple[Path, int]) -> None:
    page, page_port = triton_page
    _write_triton(page, 0)
    jobs = []
    for overlay, target, path in (("kserve", kserve.removeprefix("http://"), "/metrics"),
                                  ("triton", f"127.0.0.1:{page_port}", "/metrics/index.html")):
        job = _servers_job(overlay)
        # Kubernetes discovery becomes a static target (its relabelling needs pod metadata); the
        # metric rules stay exactly as rendered.
        del job["kubernetes_sd_configs"], job["relabel_configs"]
        job.update(job_name=overlay, metrics_path=path, static_configs=[{"targets": [target]}])
        jobs.append(job)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}))
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    prometheus = procs.start_ready(
        "prometheus", ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                       f"--web.listen-address=127.0.0.1:{port}"],
        tmp_path / "logs", [(procs.http_ok(f"{url}/-/ready"), 60, "ready")])
    try:
        n = 0

        def traffic_scraped() -> bool:
            nonlocal n
            n += 1
            _write_triton(page, n)
            r = local_http().post(f"{kserve}/v1/models/sk-learn.iris:predict", json={"instances": [[1, 2]]},
                                  timeout=10)
            assert r.status_code == 200, r.text
            return all(len(_query(url, f"rate({m}[5s]) > 0")) > 0 for m in (
                'request_predict_seconds_count{job="kserve"}', 'nv_inference_count{job="triton"}'))

        eventually(traffic_scraped, timeout=60, interval=0.5)
        # The model as the filter's stat names spell it (`model`, whatever the server called it).
        kserve_series = _query(url, '{job="kserve", __name__=~"request_.*"}')
        assert kserve_series and {s["metric"]["model"] for s in kserve_series} == {"sk_learn_iris"}
        triton_series = _query(url, '{job="triton", __name__=~"nv_inference_.*"}')
        assert {s["metric"]["__name__"] for s in triton_series} == {
            "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
            "nv_inference_exec_count"}
        assert {s["metric"]["model"] for s in triton_series} == {"resnet_50_v1"}
        # Nothing else from the merged page: Envoy's stats, the runtimes' process metrics.
        assert not _query(url, '{job=~"kserve|triton", __name__=~"envoy_.*|go_.*|python_.*|process_.*"}')
        # The dashboard's engine panels show both servers.
        shown: dict[str, set[str]] = {}
        for panel in json.loads(DASHBOARD.read_text())["panels"]:
            for target in panel.get("targets", []):
                if "meshcache_engine_" in target["expr"]:
                    expr = target["expr"].replace("$__rate_interval", "10s").replace("$model", ".*")
                    shown.setdefault(panel["title"], set()).update(
                        s["metric"].get("model", "") for s in _query(url, expr))
        assert shown["Engine requests /s per model"] == {"sk_learn_iris", "resnet_50_v1"}
        assert shown["Engine latency per model"] == {"sk_learn_iris"}  # Triton: no histogram by default
        assert shown["Engine failures /s"] == {"resnet_50_v1"}
        assert shown["Mean batch size per model"] == {"resnet_50_v1"}
    finally:
        prometheus.stop()

