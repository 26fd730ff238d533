"""Prometheus for meshcache on Kubernetes: PodMonitors for the Prometheus Operator, and the one
`model` label that filter and server metrics share.

The filter's per-policy stats are named after the model (`meshcache_policy_<model>_hits` once
Envoy's Prometheus output has turned every character outside [A-Za-z0-9_] into `_`), so the
filter side can only ever know `mlp_classifier`; the servers label their own metrics with the
model's real name (`mlp-classifier`: meshcache's engine, Triton's `nv_inference_*`). One value
for both: the filter rules move the model into a `model` label, the server rules rewrite the
server's `model` label the way Envoy rewrote the stat name. Prometheus relabelling has no
replace-all, so each server rule replaces one such character (the last); SANITIZE_STEPS of them
cover model names with that many. deploy/prometheus/*.yml carry the same rules
(tests/status/test_dashboard.py checks that they are these).

In front of the user's own servers (no meshcache engine) the same `model` label reaches their
metrics: Triton's `nv_inference_*{model}` and a KServe Python runtime's `request_*_seconds{model_name}`
(model_name copied into `model`), through the Istio agent's merged page (:15020, the server's
own metrics merged in when its pod carries Istio's `prometheus.io/*` annotations, as KServe sets
with `serving.kserve.io/enable-prometheus-scraping` and Triton's chart with `podAnnotations`),
for the pods `--engine-selector` picks.
"""

from __future__ import annotations

import re
from typing import Any

from meshcache.contract.extensions import Workloads

from .crossref import SIDECAR_STATS_PORT_NAME

Obj = dict[str, Any]
SANITIZE_STEPS = 8
# Istio's injected istio-proxy container declares Envoy's Prometheus listener under this name.
SIDECAR_STATS_PORT = SIDECAR_STATS_PORT_NAME
_POLICY_STAT = r"meshcache_policy_(.+)_(hits|misses|entries|bytes|tokens_saved_prompt|tokens_saved_completion)"
# The filter's per-reason bypass counters (`meshcache.bypass.<detail>`, Envoy's Prometheus output
# `meshcache_bypass_<detail with - as _>`) become `meshcache_bypasses_by_reason{reason="<detail>"}`,
# the reason spelled as in `Cache-Status: ...; detail=<detail>`. No detail has more than
# REASON_HYPHENS hyphens (filter/core/src/names.rs; tests/filter/test_http_cache.py checks).
_BYPASS_STAT = r"meshcache_bypass_(.+)"
BYPASS_REASON_METRIC = "meshcache_bypasses_by_reason"
REASON_HYPHENS = 2
# The sidecar's own verdict on the filter config it was sent (by this control plane or by
# istiod): Envoy's `extension_config_discovery.http_filter.<filter>.config_fail|config_reload`
# has no tag rule, so its Prometheus name carries the filter's name; any filter whose name holds
# `meshcache` (`meshcache`, `meshcache-native`, Istio's `<ns>.<name>`) becomes
# `meshcache_config_fail|reload{filter="<name as Envoy spelled it>"}`.
_ECDS_STAT = r"envoy_extension_config_discovery_http_filter_(.*meshcache.*)_config_(fail|reload)"


# The per-policy series carry the policy's model prefix twice: as `policy` (what it is: a prefix,
# `llama` covers `llama3-70b` too) and, kept for the dashboards and the join with the servers'
# own `model` label, as `model` (equal to a model's name only where the prefix is the full name).
def filter_model_rules() -> list[Obj]:
    """Prometheus `metric_relabel_configs` for sidecar stats: the native host's names as the Wasm
    filter's (an Envoy without a Wasm filter keeps `envoy_wasmcustom_` in front), the sidecar's
    filter config reloads and rejections (NACKs) under meshcache names, then the model into a
    `model` label and each bypass counter's reason into a `reason` label."""
    return [
        {"source_labels": ["__name__"], "regex": "envoy_wasmcustom_(meshcache_.+)", "target_label": "__name__",
         "replacement": "$1"},
        {"source_labels": ["__name__"], "regex": _ECDS_STAT, "target_label": "filter", "replacement": "$1"},
        {"source_labels": ["__name__"], "regex": _ECDS_STAT, "target_label": "__name__",
         "replacement": "meshcache_config_$2"},
        {"source_labels": ["__name__"], "regex": _POLICY_STAT, "target_label": "policy", "replacement": "$1"},
        {"source_labels": ["__name__"], "regex": _POLICY_STAT, "target_label": "model", "replacement": "$1"},
        {"source_labels": ["__name__"], "regex": _POLICY_STAT, "target_label": "__name__",
         "replacement": "meshcache_policy_$2"},
        {"source_labels": ["__name__"], "regex": _BYPASS_STAT, "target_label": "reason", "replacement": "$1"},
        *({"source_labels": ["reason"], "regex": "(.*)_(.*)", "target_label": "reason", "replacement": "${1}-${2}"}
          for _ in range(REASON_HYPHENS)),
        {"source_labels": ["__name__"], "regex": _BYPASS_STAT, "target_label": "__name__",
         "replacement": BYPASS_REASON_METRIC},
    ]


def server_model_rules() -> list[Obj]:
    """Prometheus `metric_relabel_configs` for a server's metrics: its `model` label as the
    filter's stat names spell the model."""
    return [{"source_labels": ["model"], "regex": "(.*)[^A-Za-z0-9_](.*)", "target_label": "model",
             "replacement": "${1}_${2}"} for _ in range(SANITIZE_STEPS)]


# The user's servers' metrics on the Istio agent's merged page, kept by name: Triton's and a KServe
# Python runtime's (the page also carries Envoy's stats, which the sidecar job scrapes already).
SERVER_METRICS = r"nv_inference_.+|request_(predict|preprocess|postprocess|explain)_seconds_.+"
MERGED_STATS_PORT = 15020


def servers_rules() -> list[Obj]:
    """The user's servers' metrics only, their model as a `model` label (a KServe Python runtime
    calls it `model_name`; Triton `model`), spelt as the filter's stat names spell it."""
    return [{"source_labels": ["__name__"], "regex": SERVER_METRICS, "action": "keep"},
            {"source_labels": ["model", "model_name"], "regex": ";(.+)", "target_label": "model",
             "replacement": "$1"},
            *server_model_rules()]


def operator_rules(rules: list[Obj]) -> list[Obj]:
    """The same rules as the Prometheus Operator's RelabelConfig (camelCase, explicit action)."""
    names = {"source_labels": "sourceLabels", "target_label": "targetLabel"}
    return [{**{names.get(k, k): v for k, v in r.items()}, "action": r.get("action", "replace")} for r in rules]


def _monitor(name: str, namespace: str, selector: dict[str, str], endpoint: Obj) -> Obj:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "meshcache"}},
            "spec": {"selector": {"matchLabels": dict(selector)}, "podMetricsEndpoints": [endpoint]}}


def pod_monitors(namespace: str, workloads: Workloads, own_engine: bool) -> list[Obj]:
    """The cached pods' sidecars (the filter's stats), the control plane, and meshcache's own engine
    when it is deployed, else the user's servers (Triton, KServe) the selector picks: their own
    metrics from the Istio agent's merged page (the address moved from Envoy's named stats port,
    the only one istio-proxy declares, to :15020), with the same `model` label."""
    color = [{"sourceLabels": ["__meta_kubernetes_pod_label_color"], "targetLabel": "color"}]
    out = [
        _monitor("meshcache-sidecars", namespace, dict(workloads.labels), {
            "port": SIDECAR_STATS_PORT, "path": "/stats/prometheus", "relabelings": color,
            "metricRelabelings": operator_rules(filter_model_rules())}),
        _monitor("meshcache-control-plane", namespace, {"app": "meshcache-control-plane"},
                 {"port": "http", "path": "/metrics"}),
    ]
    if own_engine:
        out.append(_monitor("meshcache-engine", namespace, {"app": "meshcache-engine"}, {
            "port": "metrics", "path": "/metrics", "relabelings": color,
            "metricRelabelings": operator_rules(server_model_rules())}))
    else:
        out.append(_monitor("meshcache-servers", namespace, dict(workloads.labels), {
            "port": SIDECAR_STATS_PORT, "path": "/stats/prometheus",
            "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_ip"], "regex": "(.+)",
                             "targetLabel": "__address__", "replacement": f"$1:{MERGED_STATS_PORT}",
                             "action": "replace"}],
            "metricRelabelings": operator_rules(servers_rules())}))
    return out


def _pod_label(name: str) -> str:
    """Prometheus's Kubernetes discovery label for a pod label (characters outside [A-Za-z0-9_] as `_`)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def kubernetes_scrape_configs(workloads: Workloads, own_engine: bool) -> list[Obj]:
    """The same three jobs as the PodMonitors for a Prometheus without the Operator (Kubernetes pod
    discovery): the sidecars of the pods `--engine-selector` picks (each label a keep rule, through
    the Istio agent's merged :15020 page), the control plane, and meshcache's engine when it runs,
    else the user's servers (their metrics on the same merged page, as the servers PodMonitor).
    deploy/prometheus/kubernetes.yml is this for the default selector; `render` writes it for the
    given one (prometheus-kubernetes.yml)."""
    selected = [{"source_labels": [_pod_label(k)], "regex": v.replace(".", r"\."), "action": "keep"}
                for k, v in sorted(workloads.labels.items())]
    pod = [{"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
    color = [{"source_labels": ["__meta_kubernetes_pod_label_color"], "target_label": "color"}]
    jobs: list[Obj] = [
        {"job_name": "meshcache-sidecars", "metrics_path": "/stats/prometheus",
         "kubernetes_sd_configs": [{"role": "pod"}],
         "relabel_configs": [
             {"source_labels": ["__meta_kubernetes_pod_container_name"], "regex": "istio-proxy", "action": "keep"},
             *selected,
             {"source_labels": ["__meta_kubernetes_pod_ip"], "regex": "(.+)", "target_label": "__address__",
              "replacement": "$1:15020"},
             {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
             *pod, *color],
         # The user's servers' own metrics, merged into the same page, go to their own job.
         "metric_relabel_configs": [
             *([] if own_engine else [{"source_labels": ["__name__"], "regex": SERVER_METRICS, "action": "drop"}]),
             *filter_model_rules()]},
        {"job_name": "meshcache-control-plane", "metrics_path": "/metrics",
         "kubernetes_sd_configs": [{"role": "pod"}],
         "relabel_configs": [
             {"source_labels": ["__meta_kubernetes_pod_label_app", "__meta_kubernetes_pod_container_port_name"],
              "regex": "meshcache-control-plane;http", "action": "keep"}, *pod]},
    ]
    if own_engine:
        jobs.append(
            {"job_name": "meshcache-engine", "metrics_path": "/metrics",
             "kubernetes_sd_configs": [{"role": "pod"}],
             "relabel_configs": [
                 {"source_labels": ["__meta_kubernetes_pod_label_app", "__meta_kubernetes_pod_container_port_name"],
                  "regex": "meshcache-engine.*;metrics", "action": "keep"}, *pod, *color],
             "metric_relabel_configs": server_model_rules()})
    else:
        jobs.append(
            {"job_name": "meshcache-servers", "metrics_path": "/stats/prometheus",
             "kubernetes_sd_configs": [{"role": "pod"}],
             "relabel_configs": [
                 {"source_labels": ["__meta_kubernetes_pod_container_name"], "regex": "istio-proxy", "action": "keep"},
                 *selected,
                 {"source_labels": ["__meta_kubernetes_pod_ip"], "regex": "(.+)", "target_label": "__address__",
                  "replacement": f"$1:{MERGED_STATS_PORT}"},
                 {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"}, *pod],
             "metric_relabel_configs": servers_rules()})
    return jobs
