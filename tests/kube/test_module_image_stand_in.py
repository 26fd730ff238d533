"""meshcache/ctl/kube/module_image.py without a cluster: the emulated module image pulled by digest
only, and its container's real command (render's copy_command) run the way the test kubelet runs
it, chrooted into the image's read-only root as UID 1337 (here in a mount namespace of its own
instead of a pod's): the right sha256 leaves the module in the volume, a wrong one fails and
leaves nothing renamed in, the image's root stays read-only. (The pod's story: tests/kube/native.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from meshcache.contract import oci
from meshcache.ctl.istio import native_module
from meshcache.ctl.kube import module_image

MODULE = "libmeshcache_native-envoy-1.39.so"


def test_the_image_is_pulled_by_its_digest_only() -> None:
    digest = module_image.digest()
    assert len(digest) == 64 and digest == module_image.digest()  # deterministic, from the builds
    assert module_image.pull_error(module_image.reference()) is None
    assert "manifest unknown" in (module_image.pull_error(f"{module_image.REPOSITORY}@sha256:{'1' * 64}") or "")
    assert "by digest only" in (module_image.pull_error(f"{module_image.REPOSITORY}:v1") or "")
    assert module_image.is_module_image(module_image.reference())
    assert module_image.is_module_image(f"{module_image.REPOSITORY}:v1")
    assert not module_image.is_module_image("registry.example.com/meshcache/filter@sha256:" + "a" * 64)


def _run(tmp_path: Path, sha256: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    root = module_image.rootfs(tmp_path / "root")
    volume = tmp_path / "volume"
    volume.mkdir()
    os.chown(volume, 1337, 1337)
    tmp_path.chmod(0o755)
    argv = module_image.run_argv(root, {native_module.COPY_DIR: volume}, 1337, 1337,
                                 native_module.copy_command(MODULE, sha256))
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", *argv], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    return out, volume


def test_the_right_sha256_copies_the_module_read_only(tmp_path: Path) -> None:
    build = module_image.DIST / MODULE
    out, volume = _run(tmp_path, oci.sha256_hex(build.read_bytes()))
    assert out.returncode == 0 and f"{native_module.COPY_DIR}/{MODULE}.tmp: OK" in out.stdout, out
    copied = volume / MODULE
    assert copied.read_bytes() == build.read_bytes()
    assert copied.stat().st_uid == 1337 and copied.stat().st_mode & 0o777 == 0o444


def test_a_wrong_sha256_fails_and_renames_nothing_in(tmp_path: Path) -> None:
    out, volume = _run(tmp_path, "0" * 64)
    assert out.returncode != 0 and "FAILED" in out.stdout, out
    assert not (volume / MODULE).exists()


def test_the_image_root_is_read_only(tmp_path: Path) -> None:
    root = module_image.rootfs(tmp_path / "root")
    argv = module_image.run_argv(root, {}, 1337, 1337, ["sh", "-c", "echo x > /meshcache/modules/other"])
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", *argv], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert out.returncode != 0 and "Read-only file system" in out.stderr, out
