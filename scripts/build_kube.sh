#!/usr/bin/env bash
# Builds a Kubernetes control plane from Go modules, once per machine: kube-apiserver,
# kube-controller-manager, kube-scheduler and kubectl from k8s.io/kubernetes, and etcd from
# go.etcd.io/etcd/server/v3, at the versions pinned in scripts/kube/versions. The result is cached
# outside the work tree under a directory keyed on that file's hash, so a pin change builds again
# and nothing else does. (pilot-agent comes from the patched istio module: scripts/build_istiod.sh.)
#
#   scripts/build_kube.sh              build if missing, print the bin directory
#   scripts/build_kube.sh --print-dir  print the bin directory (built or not), build nothing
#
# Cold on 2 cores: ~14 min (kube-apiserver alone ~8.5 min and 2.3 GB RSS), ~0.6 GB module cache and
# ~3 GB Go build cache. MESHCACHE_CACHE (default /var/cache/meshcache) moves the cache.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
versions_file="$here/kube/versions"
# shellcheck source=kube/versions
. "$versions_file"
key="$(sha256sum < "$versions_file" | cut -c1-12)"
cache="${MESHCACHE_CACHE:-/var/cache/meshcache}"
root="$cache/kube-$key"
bin="$root/bin"
tools=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd)

if [ "${1:-}" = "--print-dir" ]; then
  echo "$bin"
  exit 0
fi
built() {
  for t in "${tools[@]}"; do [ -x "$bin/$t" ] || return 1; done
}
if built; then
  echo "$bin"
  exit 0
fi

export PATH="$PATH:/usr/local/go/bin"
if ! command -v go >/dev/null 2>&1; then
  echo "build_kube: 'go' not found: the cluster is built from k8s.io/kubernetes@$KUBERNETES_VERSION and needs Go >= 1.26 (https://go.dev/dl/), on PATH or in /usr/local/go/bin" >&2
  exit 1
fi
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

# Several work trees may run setup at once: one builds, the others wait for it and reuse the result.
mkdir -p "$root"
exec 9>"$root.lock"
flock 9
if built; then
  echo "$bin"
  exit 0
fi

start=$(date +%s)
echo "build_kube: k8s.io/kubernetes@$KUBERNETES_VERSION, etcd $ETCD_VERSION -> $bin (once per machine, ~14 min cold)" >&2
module_dir() {  # the read-only module cache directory of $1@$2
  local dir
  dir="$(go mod download -json "$1@$2" | sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')"
  if [ -z "$dir" ] || [ ! -f "$dir/go.mod" ]; then
    echo "build_kube: go mod download $1@$2 gave no module directory" >&2
    exit 1
  fi
  echo "$dir"
}
# A writable copy of a module (the module cache is read-only), next to the output.
work="$(mktemp -d "$root/src.XXXXXX")"
trap 'rm -rf "$work"' EXIT
copy_module() {  # module version dest
  mkdir -p "$3"
  cp -r "$(module_dir "$1" "$2")/." "$3/"
  chmod -R u+w "$3"
}
mkdir -p "$root/bin.tmp"

# k8s.io/kubernetes: its module zip leaves out staging/ (nested modules) and vendor/ is empty, so
# each `k8s.io/x => ./staging/src/k8s.io/x` replace becomes a require of the published
# k8s.io/x@v0.<minor>.<patch> of the same release (the go.work files point at staging/ too).
k8s="$work/kubernetes"
copy_module k8s.io/kubernetes "$KUBERNETES_VERSION" "$k8s"
rm -f "$k8s/go.work" "$k8s/go.work.sum"
staging_version="v0.${KUBERNETES_VERSION#v1.}"
edits=()
while read -r mod; do
  edits+=("-dropreplace=$mod")
  if grep -qE "^\s+$mod v0\.0\.0" "$k8s/go.mod"; then
    # k8s.io/sample-apiserver is required (for its tests) but never published.
    if [ "$mod" = "k8s.io/sample-apiserver" ]; then
      edits+=("-droprequire=$mod")
    else
      edits+=("-require=$mod@$staging_version")
    fi
  fi
done < <(sed -n 's#^\s*\(k8s.io/[^ ]*\) => \./staging/.*#\1#p' "$k8s/go.mod")
(cd "$k8s" && go mod edit "${edits[@]}")
# The version the binaries report (`kubectl version` refuses the module default
# `v0.0.0-master+$Format:%H$`); "archive" is Kubernetes' own tree state for builds from a tarball.
minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
build_date="$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/$KUBERNETES_VERSION.info")"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=archive -X $pkg.buildDate=${build_date:-1970-01-01T00:00:00Z}"
done
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  t=$(date +%s)
  (cd "$k8s" && go build -mod=mod -trimpath -ldflags "$k8s_ldflags" -o "$root/bin.tmp/$cmd" "./cmd/$cmd")
  echo "build_kube: $cmd in $(( $(date +%s) - t ))s" >&2
done

# etcd: the server module replaces its sibling modules with ../ paths; require them at the release.
etcd="$work/etcd"
copy_module go.etcd.io/etcd/server/v3 "$ETCD_VERSION" "$etcd"
edits=()
while read -r mod; do
  edits+=("-dropreplace=$mod" "-require=$mod@$ETCD_VERSION")
done < <(sed -n 's#^\s*\(go.etcd.io/etcd/[^ ]*\) => \.\./.*#\1#p' "$etcd/go.mod")
[ ${#edits[@]} -eq 0 ] || (cd "$etcd" && go mod edit "${edits[@]}")
t=$(date +%s)
(cd "$etcd" && go build -mod=mod -trimpath -ldflags "-s -w" -o "$root/bin.tmp/etcd" .)
echo "build_kube: etcd in $(( $(date +%s) - t ))s" >&2

rm -rf "$bin"
mv "$root/bin.tmp" "$bin"
echo "build_kube: built in $(( $(date +%s) - start ))s" >&2
echo "$bin"
