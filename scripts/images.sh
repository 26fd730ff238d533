#!/usr/bin/env bash
# `make images`: the engine and control-plane images (engine/Dockerfile, control_plane/Dockerfile)
# from the project's wheel, and the native module image (filter/native/Dockerfile: the dynamic
# module builds in filter/dist/, for render --filter native), on a Debian 12 base pinned by digest.
#
#   scripts/images.sh [IMAGE...]   IMAGE: engine, control-plane, filter-native (default: all three)
#
#   MESHCACHE_BASE_IMAGE   the base, `REPO@sha256:DIGEST` (e.g. a Debian 12 slim image you verified);
#                          default: a Debian 12 minbase built here with debootstrap from Debian's
#                          mirror and pinned by its own digest (no registry needed).
#   MESHCACHE_IMAGE_TAG    tag of the images (default: the project version)
#   MESHCACHE_BUILDER      buildah, podman or docker (default: the first found)
#
# `scripts/images.sh --prepare` builds only what changes with the machine and the pins, not with the
# project's code: the default base, and the Dockerfiles' `deps` and `runtime` stages (the Debian
# packages and the pinned dependencies). make setup runs it, so the debootstrap and the big layers
# happen once per machine, with the other per-machine builds; `make images` then adds the project.
set -euo pipefail
prepare=false
[ "${1:-}" = --prepare ] && { prepare=true; shift; }
cd "$(dirname "$0")/.."
wanted=("$@")
[ ${#wanted[@]} -eq 0 ] && wanted=(engine control-plane filter-native)
python_images=()
native=false
for image in "${wanted[@]}"; do
  case "$image" in
    engine|control-plane) python_images+=("$image") ;;
    filter-native) native=true ;;
    *) echo "images: unknown image $image (engine, control-plane, filter-native)" >&2; exit 2 ;;
  esac
done
# The native module image carries both dynamic-module builds; render pins their sha256 from the same files.
native_modules=(filter/dist/libmeshcache_native-envoy-1.39.so filter/dist/libmeshcache_native.so)
if $native && ! $prepare; then
  for f in "${native_modules[@]}"; do
    [ -f "$f" ] || { echo "images: $f is missing: build the modules first (make filter)" >&2; exit 2; }
  done
fi

builder=${MESHCACHE_BUILDER:-}
if [ -z "$builder" ]; then
  for b in buildah podman docker; do
    if command -v "$b" >/dev/null 2>&1; then builder=$b; break; fi
  done
fi
if [ -z "$builder" ]; then
  echo "images: no image builder (buildah, podman or docker) on PATH; on Debian 12: apt-get install buildah" >&2
  exit 2
fi
if [ "$builder" = docker ] && ! docker info >/dev/null 2>&1; then
  echo "images: docker is installed but its daemon is not reachable; use buildah (MESHCACHE_BUILDER=buildah)" >&2
  exit 2
fi

version=$(.venv/bin/python -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
tag=${MESHCACHE_IMAGE_TAG:-$version}

base=${MESHCACHE_BASE_IMAGE:-}
if [ -z "$base" ]; then
  if [ "$builder" = docker ]; then
    echo "images: with docker, set MESHCACHE_BASE_IMAGE=REPO@sha256:DIGEST (a Debian 12 image)" >&2
    exit 2
  fi
  local_base=localhost/meshcache/debian:12-debootstrap
  if ! "$builder" inspect --type image "$local_base" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || { echo "images: debootstrap is needed for the local base" >&2; exit 2; }
    rootfs=$(mktemp -d)
    trap 'rm -rf "$rootfs"' EXIT
    echo "images: building a Debian 12 base with debootstrap (once)"
    debootstrap --variant=minbase bookworm "$rootfs/root" http://deb.debian.org/debian >/dev/null
    rm -rf "$rootfs"/root/var/cache/apt/archives/*.deb "$rootfs"/root/var/lib/apt/lists/*
    tar -C "$rootfs/root" -cf "$rootfs/root.tar" .
    if [ "$builder" = buildah ]; then
      # buildah has no `import` (Debian 12's 1.28): an empty container, the tree added (a local
      # tar archive is unpacked), committed as the image.
      ctr=$(buildah from scratch)
      buildah add --quiet "$ctr" "$rootfs/root.tar" / >/dev/null
      buildah commit --quiet "$ctr" "$local_base" >/dev/null
      buildah rm "$ctr" >/dev/null
    else
      "$builder" import "$rootfs/root.tar" "$local_base" >/dev/null
    fi
  fi
  digest=$("$builder" images --format '{{.Digest}}' "$local_base" | head -1)
  base="localhost/meshcache/debian@$digest"
fi
case "$base" in
  *@sha256:*) ;;
  *) echo "images: MESHCACHE_BASE_IMAGE must be pinned by digest (REPO@sha256:DIGEST), got $base" >&2; exit 2 ;;
esac

# What --prepare builds depends only on the base, the Dockerfiles and the pins (pyproject.toml):
# a tag named after them says it was built, so `make setup` is quick when nothing changed.
prepared="localhost/meshcache/prepared:$(cat engine/Dockerfile control_plane/Dockerfile scripts/image_rootfs.py pyproject.toml \
  <(echo "$base") | sha256sum | cut -c1-16)"
if $prepare && "$builder" inspect --type image "$prepared-engine" >/dev/null 2>&1 \
    && "$builder" inspect --type image "$prepared-control-plane" >/dev/null 2>&1; then
  echo "images: base $base; the deps and runtime stages are built for these pins"
  exit 0
fi

# The wheel and every pinned dependency, fetched here with this machine's pip settings: the image
# build itself installs offline (pip --no-index), so it needs no registry access or CA of its own.
# The dependencies are resolved for the image's Python, Debian 12's 3.11.2 on glibc 2.36 (binary
# wheels only). pip evaluates python_full_version markers with this interpreter's version, so
# redis's `async-timeout; python_full_version < "3.11.3"` is named explicitly.
# The project's wheel in dist/wheel/self, each image's dependencies in dist/wheel/deps-IMAGE (their own layer).
if $prepare || [ ${#python_images[@]} -gt 0 ]; then
  rm -rf dist/wheel
  # Zip timestamps from the last commit: the same sources give the same wheel, so the builder's
  # layer cache (buildah --layers) skips the install when nothing changed.
  SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 315532800) \
    .venv/bin/pip wheel -q --no-deps -w dist/wheel/self . 2>/dev/null
  platforms=(--platform any --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
  # Each image gets its component's extra only (pyproject.toml): the control plane no Envoy,
  # onnxruntime or numpy, the engine no Envoy.
  for extra in engine control-plane; do
    .venv/bin/pip download -q --dest "dist/wheel/deps-$extra" --only-binary=:all: --python-version 3.11.2 \
      --implementation cp --abi cp311 --abi abi3 --abi none "${platforms[@]}" \
      "$(echo dist/wheel/self/meshcache-*.whl)[$extra]" "async-timeout==5.0.1"
    rm -f dist/wheel/deps-"$extra"/meshcache-*.whl
  done
fi
case "$builder" in
  # chroot isolation: no nested container runtime needed (works inside an unprivileged container).
  buildah) build=(buildah bud --layers --isolation chroot --network host --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)") ;;
  podman) build=(podman build --network host) ;;
  docker) build=(docker build) ;;
esac
# OCI labels: the commit built (with `-dirty` when the tree has changes) and where it comes from.
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || revision="$revision-dirty"
source=$(git remote get-url origin 2>/dev/null || true)
labels=(--build-arg "VERSION=$version" --build-arg "REVISION=$revision" --build-arg "SOURCE=$source")
if $prepare; then
  for image in engine control-plane; do
    dockerfile=engine/Dockerfile
    [ "$image" = control-plane ] && dockerfile=control_plane/Dockerfile
    "${build[@]}" --quiet --build-arg "BASE=$base" "${labels[@]}" -f "$dockerfile" --target runtime -t "$prepared-$image" . >/dev/null
  done
  echo "images: base $base; the deps and runtime stages are built"
  exit 0
fi
for image in "${wanted[@]}"; do
  case "$image" in
    engine) dockerfile=engine/Dockerfile ;;
    control-plane) dockerfile=control_plane/Dockerfile ;;
    filter-native) dockerfile=filter/native/Dockerfile ;;
  esac
  echo "images: meshcache/$image:$tag (base $base)"
  previous=$("$builder" images -q "meshcache/$image:$tag" 2>/dev/null | head -1 || true)
  "${build[@]}" --build-arg "BASE=$base" "${labels[@]}" -f "$dockerfile" -t "meshcache/$image:$tag" .
  # The image this tag named before, now untagged (rebuilds would pile them up).
  current=$("$builder" images -q "meshcache/$image:$tag" | head -1)
  if [ -n "$previous" ] && [ "$previous" != "$current" ]; then "$builder" rmi "$previous" >/dev/null 2>&1 || true; fi
done
if [ ${#python_images[@]} -gt 0 ]; then
  echo "images: built $(printf 'meshcache/%s:'"$tag"' ' "${python_images[@]}"); push them and render with"
  echo "  meshcache istio render --engine-image REGISTRY/meshcache/engine:$tag --control-plane-image REGISTRY/meshcache/control-plane:$tag"
fi
if $native; then
  # The manifest digest in local storage (what a pod on this node pins); a push may re-compress the
  # layers and change it, so pin the pushed one: buildah push --digestfile prints it.
  # (the whole listing read, then its first line: `| head -1` would end the lister with SIGPIPE,
  # which pipefail makes this script's failure, when the image carries more than one tag)
  digest=$("$builder" images --format '{{.Digest}}' "meshcache/filter-native:$tag")
  digest=${digest%%$'\n'*}
  case "$digest" in sha256:*) ;; *) digest="" ;; esac
  mkdir -p dist/images
  {
    printf '{"image": "localhost/meshcache/filter-native:%s", "digest": "%s", "modules": {' "$tag" "$digest"
    sep=""
    for f in "${native_modules[@]}"; do
      printf '%s"%s": "%s"' "$sep" "$(basename "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"
      sep=", "
    done
    printf '}}\n'
  } >dist/images/filter-native.json
  echo "images: built meshcache/filter-native:$tag${digest:+ (local digest $digest)}; recorded in dist/images/filter-native.json"
  for f in "${native_modules[@]}"; do echo "  $(basename "$f") sha256 $(sha256sum "$f" | cut -d' ' -f1)"; done
  echo "push it, then render (or set the chart's filter.native.image and filter.native.sha256) with the pushed digest:"
  echo "  buildah push --digestfile dist/images/filter-native.pushed meshcache/filter-native:$tag docker://REGISTRY/meshcache/filter-native:$tag"
  echo "  meshcache istio render --filter native --istio-version 1.31 --native-image REGISTRY/meshcache/filter-native@\$(cat dist/images/filter-native.pushed)"
fi
