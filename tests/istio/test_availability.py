"""A hung control plane cannot block istiod, statically: every build keeps a ready, really serving
replica for istiod's `xds://` Service (probes through the xDS path, PodDisruptionBudget,
anti-affinity, priority class, surge-only rollouts, no unready endpoints), the new objects pass
Kubernetes' schemas, and broken variants are caught. Redis persistence (AOF on a volume claim) is
on wherever the manifests run Redis."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from meshcache.ctl.istio import crossref, kustomize, render, validate
from tests.istio.helpers import KUSTOMIZATIONS

Obj = dict


def _find(objs: list[Obj], kind: str, name: str = crossref.CONTROL_PLANE) -> Obj:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _container(objs: list[Obj]) -> Obj:
    return _find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_every_build_keeps_a_serving_control_plane_for_istiod(directory: Path) -> None:
    objects = kustomize.build(directory)
    assert crossref.check_availability(objects) == []
    report = validate.validate_all(o for o in objects if o["kind"] in ("Deployment", "Service", "PodDisruptionBudget",
                                                                         "PriorityClass"))
    assert report.ok, "\n".join(report.errors)
    c = _container(objects)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz/xds", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz/xds", "port": "http"}
    # A wedged process (each probe then lasts its timeout): out of the Service within 4 s, killed
    # within 6 s (+1 s grace, which a stopped process does not use).
    r, lv = c["readinessProbe"], c["livenessProbe"]
    assert r["failureThreshold"] * max(r["periodSeconds"], r["timeoutSeconds"]) <= 4
    assert lv["failureThreshold"] * max(lv["periodSeconds"], lv["timeoutSeconds"]) <= 6
    assert lv["terminationGracePeriodSeconds"] <= 1
    pc = _find(objects, "PriorityClass")
    assert "namespace" not in pc["metadata"] and pc["value"] > 0 and not pc["globalDefault"]
    assert _find(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    assert _find(objects, "Deployment")["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_render_keeps_them_in_another_namespace(filter_wasm: Path) -> None:
    objects = render.render(render.RenderOptions(namespace="ml", module_path=filter_wasm))
    assert crossref.check_availability(objects) == []
    assert _find(objects, "PodDisruptionBudget")["metadata"]["namespace"] == "ml"
    assert "namespace" not in _find(objects, "PriorityClass")["metadata"]


def _tcp_readiness(o: list[Obj]) -> None:
    _container(o)["readinessProbe"] = {"tcpSocket": {"port": "xds"}}


def _plain_liveness(o: list[Obj]) -> None:
    _container(o)["livenessProbe"]["httpGet"]["path"] = "/healthz"


def _no_startup_probe(o: list[Obj]) -> None:
    del _container(o)["startupProbe"]


def _one_replica(o: list[Obj]) -> None:
    _find(o, "Deployment")["spec"]["replicas"] = 1


def _unavailable_rollout(o: list[Obj]) -> None:
    _find(o, "Deployment")["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] = 1


def _recreate(o: list[Obj]) -> None:
    _find(o, "Deployment")["spec"]["strategy"] = {"type": "Recreate"}


def _no_priority(o: list[Obj]) -> None:
    del _find(o, "Deployment")["spec"]["template"]["spec"]["priorityClassName"]


def _missing_priority_class(o: list[Obj]) -> None:
    o.remove(_find(o, "PriorityClass"))


def _no_anti_affinity(o: list[Obj]) -> None:
    del _find(o, "Deployment")["spec"]["template"]["spec"]["affinity"]


def _no_pdb(o: list[Obj]) -> None:
    o.remove(_find(o, "PodDisruptionBudget"))


def _unready_endpoints(o: list[Obj]) -> None:
    _find(o, "Service")["spec"]["publishNotReadyAddresses"] = True


BREAKS: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "TCP readiness": (_tcp_readiness, "a TCP check passes on a stopped process"),
    "liveness without xDS": (_plain_liveness, "livenessProbe must be httpGet /healthz/xds"),
    "no startup probe": (_no_startup_probe, "startupProbe must be httpGet /healthz/xds"),
    "one replica": (_one_replica, "needs 2 replicas"),
    "rollout takes a replica away": (_unavailable_rollout, "maxUnavailable must be 0"),
    "recreate": (_recreate, "maxUnavailable must be 0"),
    "no priority": (_no_priority, "no priorityClassName"),
    "priority class missing": (_missing_priority_class, "no such PriorityClass"),
    "no anti-affinity": (_no_anti_affinity, "no pod anti-affinity"),
    "no PDB": (_no_pdb, "no PodDisruptionBudget"),
    "unready endpoints": (_unready_endpoints, "publishNotReadyAddresses"),
}


@pytest.mark.parametrize("name", BREAKS)
def test_a_control_plane_that_could_block_istiod_is_caught(name: str) -> None:
    objs = kustomize.build(render.BASE_DIR)
    breaker, expected = BREAKS[name]
    breaker(objs)
    errors = crossref.check_availability(objs)
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_redis_persistence_is_on_wherever_redis_runs(directory: Path) -> None:
    """AOF (fsync every second) in a directory on a PersistentVolumeClaim; external-redis runs none
    (the control plane reads the URL of a managed Redis from a Secret)."""
    objects = kustomize.build(directory)
    redis = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "meshcache-redis"]
    if directory.name == "external-redis":
        assert not redis
        url = next(e for e in _container(objects)["env"] if e["name"] == "MESHCACHE_CP_REDIS_URL")
        assert url["valueFrom"]["secretKeyRef"]["name"] == "meshcache-redis-url"
        return
    (sts,) = redis
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] in ("everysec", "always")
    data_dir = args[args.index("--dir") + 1]
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert any(m["mountPath"] == data_dir and m["name"] in claims for m in c["volumeMounts"])
