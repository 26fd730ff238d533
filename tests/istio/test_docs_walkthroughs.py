"""docs/istio.md's two walk-throughs, followed top to bottom: every `meshcache` command runs as
written (render, validate, xds-certs, oci-layout), every file a later command uses (kubectl,
istioctl, helm) exists by then, and the namespace comes before the Secrets in it, the Secrets
before the manifests, the manifests before istiod reads the control plane. Commands that need a
cluster or a registry (kubectl, istioctl, helm, buildah, skopeo) are checked for their files only;
`kubectl get ... -o yaml > isvc.yaml` is stood in for by the KServe manifests of
test_existing_servers."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from meshcache.contract.paths import REPO_ROOT
from meshcache.ctl.cli import main
from tests.istio.test_existing_servers import kserve_predictor

DOC = REPO_ROOT / "docs" / "istio.md"
WALKTHROUGHS = ("Walk-through 1: a fresh mesh", "Walk-through 2: an existing mesh with a KServe InferenceService",
                "Walk-through 3: delivery kube (istiod untouched)")


def _commands(title: str) -> list[str]:
    """The shell commands of a walk-through's code blocks, continuation lines joined, comments cut."""
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    blocks: list[list[str]] = []
    fence: str | None = None  # the open fence's info string ("" for shell blocks)
    for line in section.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:] if fence is None else None
            if fence == "":
                blocks.append([])
        elif fence == "":
            blocks[-1].append(stripped)
    commands: list[str] = []
    for block in blocks:
        for line in re.sub(r"\\\n\s*", " ", "\n".join(block)).splitlines():
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+#.*$", "", line))
    return commands


def _files(command: str) -> list[str]:
    """Local files a command reads (-f, --cert, --key, --from-file, --workload, validate's globs)."""
    flags = r"(?:-f|--cert=|--key=|--from-file=(?:[\w.]+=)?|--workload)"
    return re.findall(flags + r"\s*([\w./*-]+\.(?:yaml|crt|key|txt))", command)


@pytest.mark.parametrize("title", WALKTHROUGHS)
def test_walkthrough_runs_top_to_bottom(title: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        filter_wasm: Path, crds: dict) -> None:
    commands = _commands(title)
    assert commands, title
    monkeypatch.chdir(tmp_path)
    (tmp_path / "istio").symlink_to(REPO_ROOT / "istio")
    (tmp_path / "isvc.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "v1", "kind": "List", "items": kserve_predictor("sklearn-iris", "ml")}))
    (tmp_path / "my-istio.yaml").write_text("")  # the user's own IstioOperator
    ran = 0
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == ".venv/bin/meshcache":
            expanded = [str(p) for a in argv[1:] for p in (sorted(tmp_path.glob(a)) if "*" in a else [a])]
            assert main(expanded) == 0, command
            ran += 1
            continue
        if argv[0] in ("printf",):  # tokens.txt
            (tmp_path / "tokens.txt").write_text("write:ops:0123456789abcdef\nread:render:0123456789abcdef\n")
            continue
        for f in _files(command):
            assert (tmp_path / f).exists(), f"{command}: {f} does not exist at this point"
    assert ran >= 3, commands

    def first(pattern: str) -> int:
        return next(i for i, c in enumerate(commands) if re.search(pattern, c))

    namespace = first(r"kubectl apply (--server-side )?-f rendered/namespace\.yaml")
    secrets = [i for i, c in enumerate(commands) if "create secret" in c]
    manifests = first(r"kubectl apply (--server-side )?-f rendered/meshcache-istio\.yaml")
    if any("--delivery kube" in c for c in commands):  # istiod is not touched at all
        assert not [c for c in commands if re.search(r"istioctl|helm|istio-operator|istiod-values|istio-system", c)]
        assert namespace < min(secrets) and max(secrets) < manifests, commands
        return
    mcp = first(r"istio-operator-(mcp|existing)\.yaml")
    assert namespace < min(secrets) and max(secrets) < manifests < mcp, commands
