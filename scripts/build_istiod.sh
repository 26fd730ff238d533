#!/usr/bin/env bash
# Builds istiod (pilot-discovery), istioctl and pilot-agent (istio-agent, the sidecar's
# supervisor: tests/kube, with the proxy image's Envoy bootstrap template) from the pinned
# istio.io/istio module, with the
# patches in scripts/istiod/patches applied, once per machine: the result is cached outside the
# work tree under a directory keyed on the module version and the patches' hash, so a version or
# patch change builds again and nothing else does.
#
#   scripts/build_istiod.sh              build if missing, print the bin directory
#   scripts/build_istiod.sh --print-dir  print the bin directory (built or not), build nothing
#
# MESHCACHE_CACHE (default /var/cache/meshcache) moves the cache.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="$(tr -d '[:space:]' < "$here/istiod/module-version")"
patches=("$here"/istiod/patches/*.patch)
patch_hash="$(cat "${patches[@]}" | sha256sum | cut -c1-12)"
root="${MESHCACHE_CACHE:-/var/cache/meshcache}/istio-${version}-${patch_hash}"
bin="$root/bin"

if [ "${1:-}" = "--print-dir" ]; then
  echo "$bin"
  exit 0
fi
if [ -x "$bin/pilot-discovery" ] && [ -x "$bin/istioctl" ] && [ -x "$bin/pilot-agent" ] && [ -f "$bin/envoy_bootstrap_tmpl.json" ]; then
  echo "$bin"
  exit 0
fi

export PATH="$PATH:/usr/local/go/bin"
if ! command -v go >/dev/null 2>&1; then
  echo "build_istiod: 'go' not found: istiod is built from istio.io/istio@$version and needs Go >= 1.26 (https://go.dev/dl/), on PATH or in /usr/local/go/bin" >&2
  exit 1
fi
# The module's go.mod says `go 1.26.0`; never let go fetch another toolchain.
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

# Several work trees may run setup at once: one builds, the others wait for it and reuse the result.
mkdir -p "$root"
exec 9>"$root.lock"
flock 9
if [ -x "$bin/pilot-discovery" ] && [ -x "$bin/istioctl" ] && [ -x "$bin/pilot-agent" ] && [ -f "$bin/envoy_bootstrap_tmpl.json" ]; then
  echo "$bin"
  exit 0
fi

start=$(date +%s)
echo "build_istiod: istio.io/istio@$version (patches $patch_hash) -> $bin" >&2
module_dir="$(go mod download -json "istio.io/istio@$version" | sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')"
if [ -z "$module_dir" ] || [ ! -f "$module_dir/go.mod" ]; then
  echo "build_istiod: go mod download istio.io/istio@$version gave no module directory" >&2
  exit 1
fi

# The module cache is read-only: build from a patched copy next to the output.
mkdir -p "$root"
work="$(mktemp -d "$root/src.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp -r "$module_dir/." "$work/"
chmod -R u+w "$work"
for p in "${patches[@]}"; do
  patch -d "$work" -p1 --forward --quiet < "$p"
done

# istiod and istioctl report this as their version (the module itself carries none).
ldflags="-X istio.io/istio/pkg/version.buildVersion=$(tr -d '[:space:]' < "$work/VERSION")-dev+${version##*-}"
mkdir -p "$root/bin.tmp"
(cd "$work" && go build -ldflags "$ldflags" -o "$root/bin.tmp/pilot-discovery" ./pilot/cmd/pilot-discovery)
(cd "$work" && go build -ldflags "$ldflags" -o "$root/bin.tmp/istioctl" ./istioctl/cmd/istioctl)
(cd "$work" && go build -ldflags "$ldflags" -o "$root/bin.tmp/pilot-agent" ./pilot/cmd/pilot-agent)
# The proxyv2 image's Envoy bootstrap template (its Dockerfile copies it to
# /var/lib/istio/envoy/envoy_bootstrap_tmpl.json): the test kubelet puts it in each pod's root.
cp "$work/tools/packaging/common/envoy_bootstrap.json" "$root/bin.tmp/envoy_bootstrap_tmpl.json"
rm -rf "$bin"
mv "$root/bin.tmp" "$bin"
echo "build_istiod: built in $(( $(date +%s) - start ))s" >&2
echo "$bin"
