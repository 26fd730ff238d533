"""`meshcache istio render --delivery kube`: the control plane writes the EnvoyFilters (or
TrafficExtensions) itself, with a namespaced Role for exactly that; istiod's configuration is not
touched (no MCP source, no istiod files). `--delivery mcp` stays the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshcache.contract import extensions
from meshcache.ctl.cli import main
from meshcache.ctl.istio import crossref, render, validate

FILES_KUBE = ["istio-operator.yaml", "namespace.yaml", "meshcache-istio.yaml", "kube-preview.yaml", "monitoring.yaml",
              "prometheus-kubernetes.yml"]


def _render(tmp_path: Path, *args: str) -> tuple[list[dict], list[dict], Path]:
    out = tmp_path / "out"
    assert main(["istio", "render", "--out", str(out), "--delivery", "kube", *args]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES_KUBE)
    return (validate.load_yaml_objects(out / "meshcache-istio.yaml"),
            validate.load_yaml_objects(out / "kube-preview.yaml"), out)


def _rbac(objects: list[dict]) -> tuple[dict, dict]:
    [role] = [o for o in objects if o["kind"] == "Role"]
    [binding] = [o for o in objects if o["kind"] == "RoleBinding"]
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    return role, binding


def test_kube_delivery_renders_a_namespaced_role_and_no_istiod_change(tmp_path: Path, pins: render.Pins,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      crds: dict) -> None:
    objects, served, out = _render(tmp_path, "--namespace", "ml-prod", "--color", "green", "--also-color", "blue")
    printed = capsys.readouterr().out
    report = validate.validate_all([*objects, *served])
    assert report.ok, report.errors
    assert crossref.check_all(objects + served, pins.image_digest, elsewhere=frozenset({"blue"})) == []

    env = render.control_plane_env(objects)
    assert env["MESHCACHE_CP_DELIVERY"] == "kube"
    role, binding = _rbac(objects)
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ml-prod"
    assert role["rules"] == [{"apiGroups": ["networking.istio.io"], "resources": ["envoyfilters"],
                              "verbs": ["get", "list", "create", "patch", "delete"]},
                             # the Role itself, the owner of what the control plane writes
                             {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"],
                              "resourceNames": [role["metadata"]["name"]], "verbs": ["get"]}]
    assert role["metadata"]["name"] == "meshcache-control-plane-istio-objects"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    cp = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == render.CONTROL_PLANE)
    account = cp["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "ml-prod"}]
    assert [o for o in objects if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == account]

    # The preview is what the writer applies: namespaced, labelled for pruning, stamped with the version.
    assert [o["metadata"]["name"] for o in served] == ["meshcache-green", "meshcache-blue", "meshcache-client"]
    for o in served:
        assert o["metadata"]["namespace"] == "ml-prod"
        assert o["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "meshcache-control-plane"}
        assert o["metadata"]["annotations"] == {"meshcache.io/snapshot-version": "1"}
    # istiod: nothing to change, and the output says so.
    step1 = validate.load_yaml_objects(out / "istio-operator.yaml")[0]
    assert [s["address"] for s in step1["spec"].get("meshConfig", {}).get("configSources", [])] in ([], ["k8s://"])
    assert "xds://" not in (out / "istio-operator.yaml").read_text()
    assert "mesh-wide changes: none" in printed and "configSources" in printed
    assert "istio-operator-mcp" not in printed and "istiod-values" not in printed


def test_kube_delivery_basic_mode_grants_trafficextensions_only(tmp_path: Path, pins: render.Pins) -> None:
    objects, served, out = _render(tmp_path, "--overlay", str(render.ISTIO_DIR / "overlays" / "basic"),
                                   "--namespace", "ml")
    # `meshcache istio validate rendered/*.yaml` takes the whole directory, the RBAC check included.
    assert main(["istio", "validate", *sorted(str(p) for p in out.glob("*.yaml"))]) == 0
    assert validate.validate_all(objects + served).ok
    assert crossref.check_all(objects + served, pins.image_digest) == []
    role, _ = _rbac(objects)
    assert role["rules"][0]["apiGroups"] == ["extensions.istio.io"]
    assert role["rules"][0]["resources"] == ["trafficextensions"]
    assert [o["kind"] for o in served] == ["TrafficExtension"]


def test_mcp_stays_the_default_with_no_kubernetes_grants(tmp_path: Path) -> None:
    objects = render.render(render.RenderOptions())
    assert render.delivery_of(objects) == "mcp"
    assert "MESHCACHE_CP_DELIVERY" not in render.control_plane_env(objects)
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]
    served = render.mcp_objects(objects, render.demo_plugin_config())
    assert all("managed-by" not in json.dumps(o["metadata"]) for o in served)


def test_the_rbac_check_names_what_is_wrong(tmp_path: Path, pins: render.Pins) -> None:
    objects = render.render(render.RenderOptions(delivery="kube"))
    role, binding = _rbac(objects)
    assert crossref.check_delivery(objects) == []

    role["rules"][0]["verbs"].append("update")
    errors = crossref.check_delivery(objects)
    assert any("is not the writer's" in e for e in errors) and any("needs a Role" in e for e in errors), errors
    role["rules"][0]["verbs"].remove("update")
    role["rules"][0]["resources"] = ["*"]
    assert any("is not the writer's" in e for e in crossref.check_delivery(objects))
    role["rules"][0]["resources"] = ["envoyfilters"]
    # The owner rule: that Role only, get only; and it must be there (else uninstall leaves the objects).
    role["rules"][1]["resourceNames"] = ["another-role"]
    assert any("is not the writer's" in e for e in crossref.check_delivery(objects))
    del role["rules"][1]["resourceNames"]
    assert any("is not the writer's" in e for e in crossref.check_delivery(objects))
    owner_rule = role["rules"].pop()
    assert any("grant get on itself" in e for e in crossref.check_delivery(objects))
    role["rules"].append({**owner_rule, "resourceNames": [role["metadata"]["name"]]})
    assert crossref.check_delivery(objects) == []

    cluster = {**binding, "kind": "ClusterRoleBinding", "metadata": {"name": "x"}}
    assert any("ClusterRole" in e for e in crossref.check_delivery([*objects, cluster]))
    without = [o for o in objects if o["kind"] != "RoleBinding"]
    assert any("needs a Role in meshcache" in e for e in crossref.check_delivery(without))
    cp = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == render.CONTROL_PLANE)
    cp["spec"]["template"]["spec"]["automountServiceAccountToken"] = False
    assert any("automountServiceAccountToken" in e for e in crossref.check_delivery(objects))
    # delivery mcp with a grant: the control plane writes nothing, so it may write nothing.
    mcp = render.render(render.RenderOptions())
    assert any("writes nothing" in e for e in crossref.check_delivery([*mcp, role, binding]))


def test_bad_delivery_options(tmp_path: Path) -> None:
    assert main(["istio", "render", "--delivery", "kube", "--mesh-tls13"]) == 2
    with pytest.raises(ValueError, match="--delivery 'crd'"):
        render.render(render.RenderOptions(delivery="crd"))
    with pytest.raises(SystemExit):
        main(["istio", "render", "--delivery", "crd"])


def test_kube_object_is_the_mcp_object_plus_metadata() -> None:
    [ef] = extensions.objects("full", colors=["blue"], url="oci://r/f@sha256:" + "a" * 64, sha256="a" * 64,
                              plugin_config={"version": "3"})[:1]
    obj = extensions.kube_object(ef, namespace="ml", version=3, revision="canary")
    assert obj["spec"] is ef["spec"] and ef["metadata"] == {"name": "meshcache-blue"}  # input untouched
    assert obj["metadata"] == {"name": "meshcache-blue", "namespace": "ml",
                               "labels": {"app.kubernetes.io/managed-by": "meshcache-control-plane",
                                          "istio.io/rev": "canary"},
                               "annotations": {"meshcache.io/snapshot-version": "3"}}
