"""The native module image (filter/native/Dockerfile), built here by `make images`'s script:
it holds both dynamic-module builds with the sha256 render pins, only the tools the init
container's command runs, and that command, exactly as `meshcache istio render --filter native`
writes it into the engine's pod template, succeeds in it (buildah, as the pod's user, the emptyDir
a temporary directory) and fails, leaving no module behind, when the checksum is not the file's."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from meshcache.contract import oci
from meshcache.contract.paths import REPO_ROOT, filter_native
from meshcache.ctl.istio import filter_host as hosts
from meshcache.ctl.istio import native_module, render
from tests.images.pods import container, deployment, pod_run
from tests.images.test_images import TAG, Containers

DOCKERFILE = REPO_ROOT / "filter" / "native" / "Dockerfile"
RECORD = REPO_ROOT / "dist" / "images" / "filter-native.json"
IMAGE = f"localhost/meshcache/filter-native:{TAG}"
MODULES = {"libmeshcache_native-envoy-1.39.so": filter_native("1.39"), "libmeshcache_native.so": filter_native("1.40")}
# What the init container's command runs (native_module.copy_command), and nothing else.
TOOLS = {"sh", "cp", "sha256sum", "chmod", "mv"}
SIZE_LIMIT_MB = 24.0  # the two modules are ~16 MB; dash, four coreutils and their libraries ~3 MB


@pytest.fixture(scope="module")
def module_image(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`scripts/images.sh filter-native`, once per run (test_images' full build, under the same
    lock, also builds it), and what it recorded."""
    if shutil.which("buildah") is None:
        pytest.fail("buildah is missing: `make setup` installs it (Debian package)")
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent
    with open(run_dir / "images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = run_dir / "filter-native.built"
        if not built.exists() and not (run_dir / "images.built").exists():
            result = subprocess.run(["scripts/images.sh", "filter-native"], cwd=REPO_ROOT, capture_output=True,
                                    text=True, timeout=600,
                                    env={**os.environ, "MESHCACHE_IMAGE_TAG": TAG, "MESHCACHE_BUILDER": "buildah"})
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            assert "meshcache istio render --filter native" in result.stdout
            built.write_text(TAG)
        return json.loads(RECORD.read_text())


def _mounted(containers: Containers, image: str) -> Path:
    name = containers.new(image)
    return Path(subprocess.run(["buildah", "mount", name], capture_output=True, text=True, check=True,
                               timeout=60).stdout.strip())


def _pinned(record: dict) -> str:
    assert re.fullmatch(r"sha256:[a-f0-9]{64}", record["digest"]), record
    return f"localhost/meshcache/filter-native@{record['digest']}"


def test_dockerfile_lint_clean() -> None:
    hadolint = Path(shutil.which("hadolint") or REPO_ROOT / ".venv" / "bin" / "hadolint")
    result = subprocess.run([str(hadolint), "--failure-threshold", "info", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_module_image_holds_the_builds_render_pins(module_image: dict, containers: Containers) -> None:
    # The record: the image's local digest and each build's sha256, the files render hashes.
    assert module_image["image"] == IMAGE
    digests = subprocess.run(["buildah", "images", "--format", "{{.Digest}}", IMAGE], capture_output=True,
                             text=True, check=True, timeout=60).stdout.split()
    assert module_image["digest"] == digests[0]
    assert module_image["modules"] == {name: oci.sha256_hex(path.read_bytes()) for name, path in MODULES.items()}
    for version in ("1.31.0", "1.31.4"):
        pins = render.native_pins_for(render.RenderOptions(filter_host="native", istio_version=version,
                                                           native_image=_pinned(module_image)))
        assert pins is not None and module_image["modules"][pins.module_file] == pins.sha256
    assert set(module_image["modules"]) == set(hosts.NATIVE_MODULE_FOR_ENVOY.values())
    # The image, opened by its pin: the builds under /meshcache/modules, the tools, their
    # libraries and the Debian records; no other program, no setuid/setgid file.
    root = _mounted(containers, _pinned(module_image))
    modules = root / native_module.IMAGE_MODULE_DIR.lstrip("/")
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in modules.iterdir()} == module_image["modules"]
    assert {p.name for p in (root / "usr" / "bin").iterdir()} == TOOLS
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    programs = {p.relative_to(root).as_posix() for p in files if os.access(p, os.X_OK) and p.suffix != ".so"
                and ".so." not in p.name and p.parent.name != "modules"}
    assert programs == {f"usr/bin/{t}" for t in TOOLS}, programs
    assert not [p for p in files if p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID)]
    assert {p.name for p in (root / "var/lib/dpkg/status.d").iterdir()} >= {"dash", "coreutils", "libc6"}
    assert (root / "usr/share/doc/coreutils/copyright").is_file()
    size = sum(p.stat().st_size for p in files) / 1e6
    assert size <= SIZE_LIMIT_MB, size
    config = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", IMAGE], capture_output=True,
                                       text=True, check=True, timeout=60).stdout)["OCIv1"]["config"]
    assert config["Labels"]["org.opencontainers.image.title"] == "meshcache-filter-native"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", config["Labels"]["org.opencontainers.image.revision"])
    assert config["User"] == "1337:1337"


def _init_container_run(record: dict, tmp_path: Path, containers: Containers,
                        sha256: str | None = None) -> tuple[subprocess.CompletedProcess[str], Path, str, dict]:
    """The rendered engine pod's module init container, run in the image as the kubelet would:
    its command, its user, the emptyDir a fresh directory. `sha256`: the one the command checks
    instead of render's (what a wrong image or file looks like to it)."""
    objects = render.render(render.RenderOptions(filter_host="native", istio_version="1.31.0",
                                                 native_image=_pinned(record)))
    dep = deployment(objects, "meshcache-engine-blue")
    init = container(dep, native_module.INIT_CONTAINER, init=True)
    assert init["image"] == _pinned(record)
    pins = render.native_pins_for(render.RenderOptions(filter_host="native", istio_version="1.31.0",
                                                       native_image=_pinned(record)))
    assert pins is not None
    if sha256 is not None:
        init = {**init, "command": [a.replace(pins.sha256, sha256) for a in init["command"]]}
    volume = tmp_path / "module"
    volume.mkdir()
    volume.chmod(0o777)  # emptyDir: writable by the pod's user
    run = pod_run(dep, init, {native_module.VOLUME: volume})
    uid = init["securityContext"]["runAsUser"]
    done = subprocess.run(containers.argv(containers.new(init["image"]), run, uid, set()), capture_output=True,
                          text=True, timeout=120)
    return done, volume, pins.module_file, render.control_plane_env(objects)


def test_rendered_init_container_copies_the_module_in_the_image(module_image: dict, tmp_path: Path,
                                                                containers: Containers) -> None:
    done, volume, module_file, env = _init_container_run(module_image, tmp_path, containers)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{module_file}.tmp: OK" in done.stdout
    # Exactly the file the sidecar loads: the name the control plane's EnvoyFilter gives (in the
    # directory istio-proxy mounts the volume at), render's sha256, read-only, written as 1337.
    assert [p.name for p in volume.iterdir()] == [module_file]
    assert env["MESHCACHE_CP_ISTIO_NATIVE_MODULE"] == native_module.sidecar_path(module_file)
    copied = volume / module_file
    assert hashlib.sha256(copied.read_bytes()).hexdigest() == module_image["modules"][module_file]
    assert stat.S_IMODE(copied.stat().st_mode) == 0o444 and copied.stat().st_uid == 1337


def test_rendered_init_container_fails_on_a_wrong_checksum(module_image: dict, tmp_path: Path,
                                                           containers: Containers) -> None:
    other = module_image["modules"]["libmeshcache_native.so"]  # the Envoy 1.40 build's: the wrong ABI here
    done, volume, module_file, _ = _init_container_run(module_image, tmp_path, containers, sha256=other)
    assert done.returncode != 0
    assert "FAILED" in done.stdout + done.stderr
    # No module where the sidecar looks (only the unchecked copy, which it never loads).
    assert not (volume / module_file).exists()
    assert [p.name for p in volume.iterdir()] == [f"{module_file}.tmp"]
