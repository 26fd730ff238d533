{{/* The label every object carries (istio/base/kustomization.yaml). */}}
{{- define "meshcache.partOf" -}}
app.kubernetes.io/part-of: meshcache
{{- end -}}

{{/* The release namespace, refused where render refuses it (Istio's and Kubernetes' own). */}}
{{- define "meshcache.namespace" -}}
{{- $reserved := list "istio-system" "istio-ingress" "istio-egress" "istio-gateways" "istio-operator" "istio-cni" "kube-system" "kube-public" "kube-node-lease" -}}
{{- if has .Release.Namespace $reserved -}}
{{- fail (printf "namespace %s: that is Istio's or Kubernetes' own namespace; install meshcache into a namespace of its own" .Release.Namespace) -}}
{{- end -}}
{{- .Release.Namespace -}}
{{- end -}}

{{/* The cached pods' labels (YAML map): cache.selector, else meshcache's own engine. */}}
{{- define "meshcache.selector" -}}
{{- if .Values.cache.selector -}}
{{- toYaml .Values.cache.selector -}}
{{- else if .Values.engine.enabled -}}
app: meshcache-engine
{{- else -}}
{{- fail "cache.selector: set the pod labels of the workloads to cache (engine.enabled is false)" -}}
{{- end -}}
{{- end -}}

{{/* The selector as the control plane reads it: k=v,k=v in the order given. */}}
{{- define "meshcache.selectorString" -}}
{{- $sel := include "meshcache.selector" . | fromYaml -}}
{{- $out := list -}}
{{- range $k, $v := $sel -}}{{- $out = append $out (printf "%s=%s" $k $v) -}}{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* The cached workloads' Service ports (the callers' side): cache.servicePorts; else meshcache's
engine Service (8000, and 8001 with a gRPC port); else the container ports. */}}
{{- define "meshcache.servicePorts" -}}
{{- $ports := concat .Values.cache.httpPorts .Values.cache.grpcPorts -}}
{{- if .Values.engine.enabled -}}
{{- $ports = ternary (list 8000 8001) (list 8000) (gt (len .Values.cache.grpcPorts) 0) -}}
{{- end -}}
{{- join "," (.Values.cache.servicePorts | default $ports) -}}
{{- end -}}

{{/* All colours: this rollout's first, then the live ones (engine on only). */}}
{{- define "meshcache.colors" -}}
{{- if .Values.engine.enabled -}}
{{- $colors := list .Values.engine.color -}}
{{- range .Values.engine.alsoColors -}}{{- if not (has . $colors) -}}{{- $colors = append $colors . -}}{{- end -}}{{- end -}}
{{- join "," $colors -}}
{{- end -}}
{{- end -}}

{{/* A principal in Istio's AuthorizationPolicy form (render normalize_principal). */}}
{{- define "meshcache.principal" -}}
{{- $p := trim (index . 1) -}}
{{- if hasPrefix "spiffe://" $p -}}{{- trimPrefix "spiffe://" $p -}}
{{- else if contains "/ns/" $p -}}{{- $p -}}
{{- else if regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$" $p -}}
{{- $parts := splitList "/" $p -}}cluster.local/ns/{{ index $parts 0 }}/sa/{{ index $parts 1 }}
{{- else -}}{{- fail (printf "cache.%s %q: use NS/SERVICEACCOUNT, TRUSTDOMAIN/ns/NS/sa/SA or spiffe://TRUSTDOMAIN/ns/NS/sa/SA" (index . 0) $p) -}}
{{- end -}}
{{- end -}}

{{/* The Role the control plane writes its objects with (delivery kube). */}}
{{- define "meshcache.writerRole" -}}meshcache-control-plane-istio-objects{{- end -}}

{{/* The cache-affinity load balancer (render extensions.consistent_hash). */}}
{{- define "meshcache.consistentHash" -}}
loadBalancer:
  consistentHash:
    httpHeaderName: x-meshcache-route-key
    ringHash:
      minimumRingSize: 4096
{{- end -}}

{{/* filter.host native: the module build for istio.version's Envoy (render filter_host.native_module_file;
tests/istio/test_helm.py checks both give the same answer for every Istio release), or fail saying why. */}}
{{- define "meshcache.nativeModule" -}}
{{- $v := toString .Values.istio.version -}}
{{- $m := regexFind "^[0-9]+\\.[0-9]+" $v | splitList "." -}}
{{- $minor := list (atoi (index $m 0)) (atoi (index $m 1)) -}}
{{- /* the Envoy each istio-proxy release is built on, and the module build for its dynamic-module ABI */ -}}
{{- $envoy := dict "1.30" "1.38" "1.31" "1.39" -}}
{{- $modules := dict "1.39" "libmeshcache_native-envoy-1.39.so" "1.40" "libmeshcache_native.so" -}}
{{- $key := join "." $minor -}}
{{- if or (lt (index $minor 0) 1) (and (eq (index $minor 0) 1) (lt (index $minor 1) 31)) -}}
{{- $builtOn := "" -}}
{{- with get $envoy $key }}{{ $builtOn = printf " (built on Envoy %s)" . }}{{ end -}}
{{- fail (printf "filter.host native needs Istio 1.31 or later: the istio-proxy of Istio %s%s does not link envoy.filters.http.dynamic_modules, so its sidecars cannot load the module; use filter.host wasm (the default) with this Istio, or set istio.version 1.31 or later" $v $builtOn) -}}
{{- end -}}
{{- $file := get $modules (get $envoy $key) -}}
{{- if not $file -}}
{{- fail (printf "filter.host native for Istio %s: which Envoy its istio-proxy is built on is not known here, and a module only loads in the Envoy whose dynamic-module ABI it was built for (filter/native/DESIGN.md); native is rendered for Istio 1.31" $v) -}}
{{- end -}}
{{- $file -}}
{{- end -}}
