#!/bin/sh
# The native module image's root filesystem (filter/native/Dockerfile, stage `rootfs`): exactly
# what the init container's command runs (meshcache/ctl/istio/native_module.py copy_command: `sh
# -c` with cp, sha256sum, chmod and mv; echo is the shell's), taken from the pinned Debian base,
# with the libraries they load (ldd) and, for scanners and licences, each Debian package a file
# comes from as /var/lib/dpkg/status.d/NAME with its copyright. Nothing else: no package manager,
# no other tool.
#
#   sh module_image_rootfs.sh ROOTFS
set -eu
root=$1
mkdir -p "$root/usr/bin"
# dash is Debian's /bin/sh; the pod spec runs `sh` from PATH (the image sets PATH=/usr/bin).
cp -L /bin/dash "$root/usr/bin/sh"
for tool in cp sha256sum chmod mv; do cp -L "$(command -v "$tool")" "$root/usr/bin/$tool"; done
files="/bin/dash $(for t in cp sha256sum chmod mv; do command -v "$t"; done)"
for f in $files; do
  ldd "$f" | while read -r line; do
    case $line in
      *"not found"*) echo "module_image_rootfs: $f: $line" >&2; exit 1 ;;
      *"=> /"*) lib=${line#*=> }; lib=${lib%% (*} ;;
      /*) lib=${line%% (*} ;;  # the ELF interpreter
      *) continue ;;
    esac
    # real files at the paths the loader asks for (no merged-/usr links needed in this image)
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
    echo "$lib" >>"$root.files"
  done
done
mkdir -p "$root/var/lib/dpkg/status.d" "$root/meshcache/modules"
# dpkg knows a merged-/usr file by the name its package ships it under (/bin/cp, but
# /usr/lib/x86_64-linux-gnu/libacl.so.1): ask for both names, each known one answers.
names=$(for f in $files $(sort -u "$root.files"); do echo "$f"; case $f in /usr/*) echo "${f#/usr}" ;; *) echo "/usr$f" ;; esac; done)
# shellcheck disable=SC2086 # one argument per path
packages=$(dpkg-query -S $names 2>/dev/null | cut -d: -f1 | tr ',' '\n' | tr -d ' ' | sort -u || true)
rm "$root.files"
for p in $packages; do
  dpkg-query -s "$p" >"$root/var/lib/dpkg/status.d/$p"
  if [ -f "/usr/share/doc/$p/copyright" ]; then
    mkdir -p "$root/usr/share/doc/$p"
    cp "/usr/share/doc/$p/copyright" "$root/usr/share/doc/$p/copyright"
  fi
done
