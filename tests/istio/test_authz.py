"""The cached pods' AuthorizationPolicy does not surprise (issue 35): every port of the workload is
covered (the inference ports for the named callers, every other port for anyone), the ingress
gateway's identity is a flag, `--authz none` leaves authorization to the user, and `validate`
warns about ports and plaintext (PERMISSIVE) callers the policy would deny, without false alarms
for the `default` ServiceAccount or for principals given by flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshcache.ctl.cli import main
from meshcache.ctl.istio import authz, crossref, render, validate
from tests.istio.test_existing_servers import KSERVE, TRITON, kserve_predictor, triton_deployment

Obj = dict


def _render(out: Path, *args: str) -> list[Obj]:
    assert main(["istio", "render", "--out", str(out), *args]) == 0
    return validate.load_yaml_objects(out / "meshcache-istio.yaml")


def _policy(objects: list[Obj]) -> Obj:
    return next(o for o in objects if o["kind"] == "AuthorizationPolicy" and o["metadata"]["name"] == render.AUTHZ)


def _list_file(path: Path, items: list[Obj]) -> Path:
    """As `kubectl get ... -o yaml` prints them: a List."""
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    return path


def _peer_auth(name: str, namespace: str, mode: str) -> Obj:
    return {"apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"mtls": {"mode": mode}}}


def _validate(capsys: pytest.CaptureFixture[str], out: Path, filter_wasm: Path, *args: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["istio", "validate", str(out), "--module", str(filter_wasm), *args])
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines() + captured.out.strip().splitlines()[-1:]


def test_every_port_of_the_triton_pods_is_covered(tmp_path: Path) -> None:
    """Triton's metrics port 8002 (Prometheus) is admitted from any source; the inference ports only
    from the named callers. The second rule follows --engine-port."""
    objects = _render(tmp_path / "out", "--overlay", str(TRITON), "--namespace", "inference")
    callers, others = _policy(objects)["spec"]["rules"]
    assert callers["to"] == [{"operation": {"ports": ["8000", "8001"]}}] and callers["from"]
    assert others == {"to": [{"operation": {"notPorts": ["8000", "8001"]}}]}, "any source, every other port"
    servers = triton_deployment("inference")
    assert not [w for w in authz.check_authorization(objects + servers) if "in no rule" in w]
    rules = callers, others
    assert [r for r in rules if authz._admits(r, 8002)] == [others]
    assert [r for r in rules if authz._admits(r, 8000)] == [callers]

    moved = _render(tmp_path / "moved", "--overlay", str(TRITON), "--engine-port", "http=9000",
                    "--engine-port", "grpc=none")
    assert [r["to"][0]["operation"] for r in _policy(moved)["spec"]["rules"]] == [
        {"ports": ["9000"]}, {"notPorts": ["9000"]}]


def test_ingress_principal_replaces_the_default_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    default = _policy(_render(tmp_path / "default"))
    assert render.INGRESS_PRINCIPAL in default["spec"]["rules"][0]["from"][0]["source"]["principals"]
    assert "annotations" not in default["metadata"], "the committed base stays a fixed point"

    helm = _policy(_render(tmp_path / "helm", "--ingress-principal", "istio-ingress/istio-ingress",
                           "--ingress-principal", "spiffe://cluster.local/ns/gw/sa/edge,gw/internal"))
    assert helm["spec"]["rules"][0]["from"][0]["source"]["principals"] == [
        "cluster.local/ns/meshcache/sa/meshcache-client", "cluster.local/ns/istio-ingress/sa/istio-ingress",
        "cluster.local/ns/gw/sa/edge", "cluster.local/ns/gw/sa/internal"]
    assert helm["metadata"]["annotations"][crossref.EXTERNAL_PRINCIPALS].split() == [
        "cluster.local/ns/istio-ingress/sa/istio-ingress", "cluster.local/ns/gw/sa/edge",
        "cluster.local/ns/gw/sa/internal"]

    capsys.readouterr()
    assert main(["istio", "render", "--ingress-principal", "istio-ingressgateway", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("meshcache istio render: --ingress-principal 'istio-ingressgateway': ")


def test_authz_none_renders_no_policy(tmp_path: Path, filter_wasm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    objects = _render(out, "--overlay", str(KSERVE), "--namespace", "ml", "--authz", "none")
    assert "AuthorizationPolicy" not in {o["kind"] for o in objects}
    code, lines = _validate(capsys, out, filter_wasm, "--workload",
                            str(_list_file(tmp_path / "isvc.yaml", kserve_predictor("my-model", "ml"))))
    assert code == 0 and lines[-1].endswith(" 0 errors"), lines  # and no warning

    for flag in ("--allow-principal", "--ingress-principal"):
        assert main(["istio", "render", "--authz", "none", flag, "ml/app", "--out", str(tmp_path / "x")]) == 2
        assert "--authz none does not render" in capsys.readouterr().err


def test_validate_warns_about_a_port_no_rule_admits(tmp_path: Path, filter_wasm: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The policy as it was (callers' rule only), e.g. from a user's overlay: Triton's metrics port
    is denied to everyone, and validate says so, naming the file, the port and the workload."""
    out = tmp_path / "out"
    objects = _render(out, "--overlay", str(TRITON), "--namespace", "inference")
    workload = str(_list_file(tmp_path / "triton.yaml", triton_deployment("inference")))
    code, lines = _validate(capsys, out, filter_wasm, "--workload", workload)
    assert code == 0 and not any("in no rule" in line for line in lines), lines

    _policy(objects)["spec"]["rules"] = _policy(objects)["spec"]["rules"][:1]
    manifests = out / "meshcache-istio.yaml"
    manifests.write_text(yaml.safe_dump_all(objects))
    code, lines = _validate(capsys, out, filter_wasm, "--workload", workload)
    assert code == 0, lines  # a warning does not fail the run
    denied = [line for line in lines if "in no rule" in line]
    assert denied == [f"{manifests}: warning: AuthorizationPolicy/meshcache-engine: port 8002 (metrics) of "
                      "Deployment/triton is in no rule, so every request to it is denied (403; e.g. Prometheus "
                      "scraping it): add a rule for it (meshcache's render admits every port but the inference "
                      "ones from any caller)"], lines
    assert lines[-1].endswith("0 errors, 3 warnings (exit status unchanged)"), lines  # + 8000, 8001 PERMISSIVE


def test_validate_warns_about_plaintext_callers_unless_mtls_is_strict(tmp_path: Path, filter_wasm: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """In front of KServe the namespace keeps its own mTLS mode (no PeerAuthentication rendered):
    Istio's default PERMISSIVE lets plaintext callers through mTLS into a 403. A mesh-wide STRICT
    PeerAuthentication given with --workload ends the warning; a namespace PERMISSIVE one wins
    over it, as in Istio; a port-level STRICT one on the predictor covers that port."""
    out = tmp_path / "out"
    _render(out, "--overlay", str(KSERVE), "--namespace", "ml")
    predictor = kserve_predictor("my-model", "ml")

    def warnings(*extra: Obj) -> list[str]:
        workload = _list_file(tmp_path / "theirs.yaml", [*predictor, *extra])
        code, lines = _validate(capsys, out, filter_wasm, "--workload", str(workload))
        assert code == 0, lines
        return [line for line in lines if ": warning: " in line]

    [plain] = warnings()
    assert "port 8080 of Deployment/my-model-predictor admits only callers with a mesh identity" in plain
    assert "its mTLS is PERMISSIVE (Istio's default" in plain and plain.startswith(f"{out / 'meshcache-istio.yaml'}: ")

    mesh_strict = _peer_auth("default", "istio-system", "STRICT")
    assert warnings(mesh_strict) == []
    [ns] = warnings(mesh_strict, _peer_auth("ml-permissive", "ml", "PERMISSIVE"))
    assert "its mTLS is PERMISSIVE (PeerAuthentication/ml-permissive)" in ns
    [off] = warnings(_peer_auth("ml-off", "ml", "DISABLE"))
    assert "its mTLS is DISABLE (PeerAuthentication/ml-off)" in off
    port_level = _peer_auth("predictor", "ml", "UNSET")
    port_level["spec"] |= {"selector": {"matchLabels": {"component": "predictor"}},
                           "portLevelMtls": {"8080": {"mode": "STRICT"}}}
    assert warnings(_peer_auth("ml-permissive", "ml", "PERMISSIVE"), port_level) == []


def test_meshcache_own_engine_is_strict_and_warns_about_nothing(tmp_path: Path, filter_wasm: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The base: PeerAuthentication STRICT in the namespace, the engine's metrics port 8002 in the
    second rule: no warning."""
    out = tmp_path / "out"
    objects = _render(out)
    engine = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "meshcache-engine-blue")
    assert {p["containerPort"] for c in engine["spec"]["template"]["spec"]["containers"] for p in c["ports"]} >= {8002}
    code, lines = _validate(capsys, out, filter_wasm)
    assert code == 0 and lines[-1].endswith(" 0 errors"), lines


def test_no_false_positive_for_default_or_principals_given_by_flag(tmp_path: Path, filter_wasm: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Callers and the gateway in the cached workloads' own namespace, given by flag (their accounts
    are the user's), a predictor running as `default`, a mesh-wide STRICT mTLS: nothing to report."""
    out = tmp_path / "out"
    _render(out, "--overlay", str(KSERVE), "--namespace", "ml", "--allow-principal", "ml/my-app",
            "--ingress-principal", "ml/gateway")
    predictor = kserve_predictor("my-model", "ml")
    predictor[0]["spec"]["template"]["spec"]["serviceAccountName"] = "default"
    workload = _list_file(tmp_path / "theirs.yaml", [*predictor, _peer_auth("default", "istio-system", "STRICT")])
    code, lines = _validate(capsys, out, filter_wasm, "--workload", str(workload))
    assert code == 0 and lines == [lines[-1]] and lines[-1].endswith(" 0 errors"), lines
    # A caller of the namespace added by hand (not by flag) is still an error: the check still bites.
    objects = validate.load_yaml_objects(out / "meshcache-istio.yaml")
    _policy(objects)["spec"]["rules"][0]["from"][0]["source"]["principals"].append("cluster.local/ns/ml/sa/typo")
    (out / "meshcache-istio.yaml").write_text(yaml.safe_dump_all(objects))
    code, lines = _validate(capsys, out, filter_wasm, "--workload", str(workload))
    assert code == 1 and any("'cluster.local/ns/ml/sa/typo' names no ServiceAccount" in line for line in lines), lines
