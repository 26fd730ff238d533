"""Run a container of a rendered Deployment the way the kubelet would, on this machine: its
command and args exactly, its environment (fieldRef values filled in), its volume mounts mapped
to temporary directories (paths in the environment and arguments follow), and its probes turned
into readiness checks. The one liberty taken: each container port the process would bind is
moved to a free loopback port through the program's own port setting (MESHCACHE_ENGINE_*_PORT,
MESHCACHE_CP_*_PORT), after checking that its default is the manifest's container port."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshcache.ctl.procs import free_port, http_ok, tcp_open

Obj = dict[str, Any]

# The program setting that moves each named container port (engine: MESHCACHE_ENGINE_<NAME>_PORT,
# control plane: MESHCACHE_CP_<NAME>_PORT), by container name.
PORT_SETTINGS: dict[str, dict[str, str]] = {
    "engine": {"http": "MESHCACHE_ENGINE_HTTP_PORT", "grpc": "MESHCACHE_ENGINE_GRPC_PORT",
               "metrics": "MESHCACHE_ENGINE_METRICS_PORT"},
    "control-plane": {"http": "MESHCACHE_CP_HTTP_PORT", "xds": "MESHCACHE_CP_XDS_PORT"},
}


@dataclass
class PodRun:
    """One container of the pod, ready to start: argv, env, the port map and its probes."""

    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> local port
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> local directory
    checks: list[tuple[Callable[[], bool], float, str]] = field(default_factory=list)


def deployment(objects: list[Obj], name: str) -> Obj:
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name)


def container(dep: Obj, name: str, init: bool = False) -> Obj:
    spec = dep["spec"]["template"]["spec"]
    return next(c for c in spec["initContainers" if init else "containers"] if c["name"] == name)


def _remap(value: str, mounts: dict[str, Path]) -> str:
    for path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if value == path or value.startswith(path.rstrip("/") + "/"):
            return str(local) + value[len(path.rstrip("/")):]
    return value


def _field(dep: Obj, path: str) -> str:
    meta = {"metadata.name": f"{dep['metadata']['name']}-0", "metadata.namespace": dep["metadata"]["namespace"]}
    return meta[path]


def pod_run(dep: Obj, c: Obj, volumes: dict[str, Path]) -> PodRun:
    """`volumes`: a local directory per pod volume name (the test fills them like the Secret or
    emptyDir would be)."""
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
    argv = [*c.get("command", []), *c.get("args", [])]
    argv = [_remap(a, mounts) for a in argv]
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _remap(str(e["value"]), mounts)
        else:
            env[e["name"]] = _field(dep, e["valueFrom"]["fieldRef"]["fieldPath"])
    run = PodRun(argv=argv, env=env, mounts=mounts)
    settings = PORT_SETTINGS.get(c["name"], {})
    for p in c.get("ports", []):
        local = free_port()
        run.ports[p["name"]] = local
        run.env[settings[p["name"]]] = str(local)
    for kind, timeout in (("readinessProbe", 60.0), ("livenessProbe", 10.0)):
        probe = c.get(kind)
        if not probe:
            continue
        if "httpGet" in probe:
            port = run.ports[probe["httpGet"]["port"]]
            run.checks.append((http_ok(f"http://127.0.0.1:{port}{probe['httpGet']['path']}"), timeout, kind))
        elif "tcpSocket" in probe:
            run.checks.append((tcp_open(run.ports[probe["tcpSocket"]["port"]]), timeout, kind))
    return run
