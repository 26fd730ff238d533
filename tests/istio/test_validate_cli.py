"""`meshcache istio validate` and `render --overlay` as a platform engineer runs them: a directory
argument, overlays named from anywhere, one line per error naming its file, no false positives
for the `default` ServiceAccount or for principals whose accounts live elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshcache.ctl.cli import main
from meshcache.ctl.istio import render
from tests.istio.test_existing_servers import KSERVE, kserve_predictor

CALLER = "cluster.local/ns/ml/sa/my-caller"  # an account the user's own manifests define


def _render_kserve(out: Path) -> None:
    assert main(["istio", "render", "--overlay", str(KSERVE), "--namespace", "ml", "--out", str(out)]) == 0


def _workload(tmp_path: Path, account: str | None) -> Path:
    """The user's KServe predictor (as `kubectl get deploy,svc -o yaml` prints it)."""
    items = kserve_predictor("my-model", "ml")
    if account is not None:
        items[0]["spec"]["template"]["spec"]["serviceAccountName"] = account
    path = tmp_path / "theirs.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    return path


def test_a_directory_validates_every_yaml_in_it(tmp_path: Path, filter_wasm: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["istio", "render", "--out", str(out)]) == 0
    files = sorted([*out.glob("*.yaml"), *out.glob("*.yml")])
    capsys.readouterr()
    assert main(["istio", "validate", str(out), "--module", str(filter_wasm)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    # istiod-values.yaml (Helm values) and prometheus-kubernetes.yml (a scrape config) are read and
    # hold no object.
    assert summary.endswith(f"in {len(files)} files, 0 errors"), summary
    assert int(summary.split()[0]) == sum(
        1 for f in files for d in yaml.safe_load_all(f.read_text()) if d and "kind" in d)
    # A broken step 1 in the directory is found, and the error names both step files.
    (out / "istio-operator.yaml").write_text((out / "istio-operator-mcp.yaml").read_text())
    assert main(["istio", "validate", str(out), "--module", str(filter_wasm)]) == 1
    err = capsys.readouterr().err
    assert f"{out / 'istio-operator.yaml'}" in err and "must not list the control plane" in err


@pytest.mark.parametrize("make", ["missing", "empty-dir", "not-yaml", "scalar"])
def test_unreadable_paths_are_one_line_errors(tmp_path: Path, make: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "manifests"
    if make == "empty-dir":
        path.mkdir()
    elif make == "not-yaml":
        path.write_text("kind: Service\n  metadata: [unclosed\n")
    elif make == "scalar":
        path.write_text("just a string\n")
    assert main(["istio", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"meshcache istio validate: {path}: ") and "Traceback" not in err


def test_every_error_is_one_line_naming_its_file(tmp_path: Path, filter_wasm: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    _render_kserve(out)
    manifests = out / "meshcache-istio.yaml"
    objects = list(yaml.safe_load_all(manifests.read_text()))
    for o in objects:
        if o["kind"] == "AuthorizationPolicy":
            o["spec"]["action"] = {"not": "an enum"}  # a schema error whose message spans lines
        if o["kind"] == "Service" and o["metadata"]["name"] == render.CONTROL_PLANE:
            o["spec"]["selector"] = {"app": "nothing-has-this"}  # a cross-reference error
    manifests.write_text(yaml.safe_dump_all(objects))
    capsys.readouterr()
    assert main(["istio", "validate", str(out), "--module", str(filter_wasm),
                 "--workload", str(_workload(tmp_path, None))]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert any("AuthorizationPolicy" in line and "action" in line for line in lines), lines
    assert any(f"Service/{render.CONTROL_PLANE}: selector matches no workload" in line for line in lines), lines
    assert all(line.startswith(f"{manifests}: ") for line in lines), lines


def test_default_service_account_exists_in_every_namespace(tmp_path: Path, filter_wasm: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    _render_kserve(out)
    capsys.readouterr()
    assert main(["istio", "validate", str(out), "--module", str(filter_wasm),
                 "--workload", str(_workload(tmp_path, "default"))]) == 0, capsys.readouterr().err
    # Any other account the manifests do not define is still an error.
    assert main(["istio", "validate", str(out), "--module", str(filter_wasm),
                 "--workload", str(_workload(tmp_path, "nobody-made-this"))]) == 1
    assert "serviceAccountName 'nobody-made-this' is not defined" in capsys.readouterr().err


def test_a_principal_given_by_flag_names_an_account_elsewhere(tmp_path: Path, filter_wasm: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A user's overlay adds a caller to the AuthorizationPolicy without meshcache's annotation:
    `--allow-principal` says its account lives elsewhere, as `render --allow-principal` does."""
    out = tmp_path / "out"
    _render_kserve(out)
    manifests = out / "meshcache-istio.yaml"
    objects = list(yaml.safe_load_all(manifests.read_text()))
    for o in objects:
        if o["kind"] == "AuthorizationPolicy" and o["spec"].get("rules"):
            o["spec"]["rules"][0]["from"][0]["source"]["principals"].append(CALLER)
    manifests.write_text(yaml.safe_dump_all(objects))
    base = ["istio", "validate", str(out), "--module", str(filter_wasm), "--workload", str(_workload(tmp_path, None))]
    capsys.readouterr()
    assert main(base) == 1
    assert f"principal {CALLER!r} names no ServiceAccount" in capsys.readouterr().err
    assert main([*base, "--allow-principal", CALLER]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("overlay", ["istio/overlays/kserve", "kserve"])
def test_overlay_resolves_outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlay: str) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["istio", "render", "--overlay", overlay, "--namespace", "ml", "--out", "out"]) == 0
    assert (tmp_path / "out" / "meshcache-istio.yaml").is_file()


def test_an_unknown_overlay_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["istio", "render", "--overlay", "no-such-overlay", "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "kserve" in err and "triton" in err, err
