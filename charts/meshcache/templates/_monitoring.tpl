{{- /* Prometheus relabelling rules, once for both consumers: the PodMonitors (monitoring.yaml,
Prometheus Operator spelling through meshcache.operatorRules) and the plain scrape config
(prometheus.yaml). The same rules as meshcache/ctl/istio/monitoring.py; tests/istio/test_helm.py
compares the output with render's. Each helper prints a YAML list (Prometheus spelling). */ -}}

{{/* Sidecar stats: the native host's names as the Wasm filter's, the sidecar's filter-config
verdicts as meshcache_config_fail|reload{filter}, the policy's model prefix as `policy` and
`model`, each bypass counter's reason as `reason` (spelt as the Cache-Status detail). */}}
{{- define "meshcache.filterRules" -}}
{{- $policy := "meshcache_policy_(.+)_(hits|misses|entries|bytes|tokens_saved_prompt|tokens_saved_completion)" -}}
{{- $ecds := "envoy_extension_config_discovery_http_filter_(.*meshcache.*)_config_(fail|reload)" -}}
{{- $bypass := "meshcache_bypass_(.+)" -}}
{{- $rules := list
  (dict "source_labels" (list "__name__") "regex" "envoy_wasmcustom_(meshcache_.+)" "target_label" "__name__" "replacement" "$1")
  (dict "source_labels" (list "__name__") "regex" $ecds "target_label" "filter" "replacement" "$1")
  (dict "source_labels" (list "__name__") "regex" $ecds "target_label" "__name__" "replacement" "meshcache_config_$2")
  (dict "source_labels" (list "__name__") "regex" $policy "target_label" "policy" "replacement" "$1")
  (dict "source_labels" (list "__name__") "regex" $policy "target_label" "model" "replacement" "$1")
  (dict "source_labels" (list "__name__") "regex" $policy "target_label" "__name__" "replacement" "meshcache_policy_$2")
  (dict "source_labels" (list "__name__") "regex" $bypass "target_label" "reason" "replacement" "$1") -}}
{{- range until 2 -}}
{{- $rules = append $rules (dict "source_labels" (list "reason") "regex" "(.*)_(.*)" "target_label" "reason" "replacement" "${1}-${2}") -}}
{{- end -}}
{{- $rules = append $rules (dict "source_labels" (list "__name__") "regex" $bypass "target_label" "__name__" "replacement" "meshcache_bypasses_by_reason") -}}
{{- toYaml $rules -}}
{{- end -}}

{{/* A server's `model` label spelt as the filter's stat names spell the model (one character
outside [A-Za-z0-9_] per rule: Prometheus relabelling has no replace-all). */}}
{{- define "meshcache.serverRules" -}}
{{- $rules := list -}}
{{- range until 8 -}}
{{- $rules = append $rules (dict "source_labels" (list "model") "regex" "(.*)[^A-Za-z0-9_](.*)" "target_label" "model" "replacement" "${1}_${2}") -}}
{{- end -}}
{{- toYaml $rules -}}
{{- end -}}

{{/* The user's servers' metrics on the Istio agent's merged page (Triton's nv_inference_*, a
KServe Python runtime's request_*_seconds): only those, the model as `model` (KServe: model_name). */}}
{{- define "meshcache.serverMetrics" -}}nv_inference_.+|request_(predict|preprocess|postprocess|explain)_seconds_.+{{- end -}}
{{- define "meshcache.serversRules" -}}
{{- $rules := list
  (dict "source_labels" (list "__name__") "regex" (include "meshcache.serverMetrics" .) "action" "keep")
  (dict "source_labels" (list "model" "model_name") "regex" ";(.+)" "target_label" "model" "replacement" "$1") -}}
{{- toYaml (concat $rules (include "meshcache.serverRules" . | fromYamlArray)) -}}
{{- end -}}

{{/* Rules (a YAML list in Prometheus spelling) as the Prometheus Operator's RelabelConfig. */}}
{{- define "meshcache.operatorRules" -}}
{{- $out := list -}}
{{- range (fromYamlArray .) -}}
{{- $r := dict "action" (.action | default "replace") -}}
{{- range $k, $v := . -}}
{{- $_ := set $r (get (dict "source_labels" "sourceLabels" "target_label" "targetLabel") $k | default $k) $v -}}
{{- end -}}
{{- $out = append $out $r -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}
