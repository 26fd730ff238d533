"""`meshcache up --kube --detach`, `status --json`, requests through the client pod's sidecar and
`down` through the console script: Kubernetes in the loop as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from meshcache.ctl.istio import render
from meshcache.ctl.kube.netns import NodeNetwork
from meshcache.ctl.kube.up import RECORD, scale_engine
from meshcache.ctl.mesh import state
from meshcache.ctl.mesh.config import MAX_REPLICAS, MeshConfig
from tests.helpers.kserve import MODEL_INFER, mlp_json, mlp_request

CLI = [str(Path(sys.executable).parent / "meshcache")]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def test_up_kube_status_requests_through_the_client_pod_and_down(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    children: list[dict[str, object]] = []
    record: dict[str, object] = {}
    try:
        # --replicas: the engine Deployment scaled (the rendering has 2).
        up = run("up", "--kube", "--replicas", "3", "--detach", "--state-dir", str(state_dir))
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        current = state.read_state(state_dir)
        assert current is not None
        children = current["children"]
        record = json.loads((state_dir / RECORD).read_text())

        status = run("status", "--json", "--state-dir", str(state_dir))
        report = json.loads(status.stdout)
        assert status.returncode == 0 and report["healthy"], status.stdout + status.stderr
        e = report["endpoints"]
        assert e["mode"] == "kube" and e["app_authority"] == render.ENGINE_APP
        assert {"app_http", "app_grpc", "app_authority", "control_plane_api", "token_file", "istiod_debug",
                "kubeconfig"} <= set(e)
        assert Path(e["kubeconfig"]).is_file()
        pods = {p["name"]: p for p in report["pods"]}
        engines = [p for n, p in pods.items() if n.startswith(f"{render.ENGINE_APP}-")]
        assert len(engines) == 3, sorted(pods)
        assert all(p["injected"] and p["ready"] and p["ip"].startswith("10.244.") for p in engines)
        assert pods["meshcache-client"]["injected"] and pods["meshcache-client"]["sidecar_ready"]
        assert all(p["sidecar_ready"] for p in engines)
        synced = {p["proxy"] for p in report["istiod"]["proxies"] if p["synced"]}
        assert {f"{n}.{e['namespace']}" for n, p in pods.items() if p["injected"]} <= synced
        text = run("status", "--state-dir", str(state_dir)).stdout
        assert text.startswith("mesh ready (") and "istio-proxy injected" in text, text

        # REST: the client pod's sidecar routes on Host, the engine pod's sidecar caches.
        body = json.dumps(mlp_json(seed=3403))
        with httpx.Client(trust_env=False, timeout=30) as client:
            answers = [client.post(f"{e['app_http']}/v2/models/mlp-classifier/infer", content=body,
                                   headers={"host": e["app_authority"], "content-type": "application/json"})
                       for _ in range(2)]
        assert [r.status_code for r in answers] == [200, 200], answers[0].text
        assert answers[0].headers["cache-status"] == "meshcache; fwd=miss; stored", answers[0].headers
        assert answers[1].headers["cache-status"].startswith("meshcache; hit; ttl=") and \
            answers[1].content == answers[0].content

        # gRPC ModelInfer, :authority the Service name.
        request = mlp_request(seed=3404).SerializeToString()
        port = e["app_grpc"].rsplit(":", 1)[1]
        with grpc.insecure_channel(e["app_grpc"], options=[("grpc.default_authority",
                                                            f"{e['app_authority']}:{port}")]) as channel:
            infer = channel.unary_unary(MODEL_INFER)
            calls = [infer.with_call(request, timeout=30) for _ in range(2)]
        marks = [dict(call.initial_metadata()).get("cache-status", "") for _, call in calls]
        assert marks[0] == "meshcache; fwd=miss; stored" and marks[1].startswith("meshcache; hit; ttl="), marks
        assert calls[0][0] == calls[1][0]

        # A policy prefix matching no model: warned from the engine pods' own index (read inside
        # them: the host's control plane cannot reach them past their sidecars), applied anyway.
        typo = run("policy", "set", "renset-mini", "--ttl", "60", "--state-dir", str(state_dir))
        assert typo.returncode == 0 and typo.stdout.startswith("set renset-mini: version"), typo.stdout + typo.stderr
        assert "warning: model_prefix 'renset-mini' matches no model the engines serve (mlp-classifier" \
            in typo.stderr, typo.stderr
        good = run("policy", "set", "resnet", "--ttl", "60", "--state-dir", str(state_dir))
        assert good.returncode == 0 and "warning" not in good.stderr, good.stdout + good.stderr
    finally:
        down = run("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stdout + down.stderr
    # Nothing left: no process it started, no network namespace, no bridge, no record.
    assert record and children
    assert not [c for c in children if state.pid_alive(int(c["pid"]), c.get("start_time"))]  # type: ignore[arg-type]
    assert not {n for n in _netns() if n.startswith(f"mc-{record['index']}-")}
    assert not _link_exists(str(record["bridge"])) and not (state_dir / RECORD).exists()
    assert state.read_state(state_dir) is None


def test_down_removes_what_a_killed_up_kube_left_behind(tmp_path: Path) -> None:
    """A supervisor killed mid-start never stopped its pods: the network it recorded
    (kube-network.json) is removed by `down`, with what still runs in the pods' namespaces."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    net = NodeNetwork.create()
    pod = net.add_pod("meshcache/orphan", "orphan", {})
    orphan = subprocess.Popen(pod.exec_argv("sleep", "300"))
    try:
        (state_dir / RECORD).write_text(json.dumps({"index": net.index, "bridge": net.bridge}))
        down = run("down", "--state-dir", str(state_dir), timeout=60)
        assert down.returncode == 0 and f"netns {pod.name} (1 processes)" in down.stdout, down.stdout + down.stderr
        assert orphan.wait(timeout=10) == -9
        assert pod.name not in _netns() and not _link_exists(net.bridge) and not (state_dir / RECORD).exists()
    finally:
        if orphan.poll() is None:
            orphan.kill()
        net.delete()


def test_replicas_with_kube_scale_the_rendered_engine_deployment() -> None:
    """`up --kube --replicas N` (MeshConfig.kube_replicas): the rendered engine Deployment at N pods,
    the rendering itself untouched; N only with --kube, and bounded."""
    rendered = render.render(render.RenderOptions())
    scaled = scale_engine(rendered, 3)

    def engine(objects: list[dict[str, Any]]) -> dict[str, Any]:
        return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["labels"].get("app")
                    == render.ENGINE_APP)

    assert engine(scaled)["spec"]["replicas"] == 3 and engine(rendered)["spec"]["replicas"] == 2
    assert [o for o in scaled if o["kind"] != "Deployment"] == [o for o in rendered if o["kind"] != "Deployment"]
    assert MeshConfig(kube=True, kube_replicas=3).kube_replicas == 3
    for bad in ({"kube_replicas": 3}, {"kube": True, "kube_replicas": MAX_REPLICAS + 1},
                {"kube": True, "replicas": 3}):
        with pytest.raises(ValueError, match="kube"):
            MeshConfig(**bad)  # type: ignore[arg-type]
