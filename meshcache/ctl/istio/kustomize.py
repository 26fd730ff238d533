"""The minimal `kustomize build` meshcache's Istio manifests need (no kubectl/kustomize here).

Supported in `kustomization.yaml` (anything else is an error, not silently ignored):
- `resources`: YAML files, or directories holding a kustomization (built recursively, in order);
- `namespace`: set on every namespaced object (cluster-scoped kinds keep none);
- `labels`: `[{pairs: {...}}]`, added to every object's metadata.labels (never to selectors or
  pod templates: those are immutable/semantic and stay as written);
- `patches`: `{path: FILE | patch: TEXT, target: {kind, name}?}`. A patch whose content is a YAML
  list is JSON 6902 (ops add/remove/replace/test, RFC 6901 paths; needs `target`); otherwise
  it is a strategic merge patch, matched by kind+name (its own or `target`). Strategic merge:
  maps merge recursively, `null` deletes a key, lists of maps that all carry `name` merge by
  name (as kustomize v5 prints them: the patch's items first, in its order, then the others),
  other lists are replaced; `$patch: delete` on the patch removes the whole object. A `null` in
  the metadata of a patch with a `target` is an error: kustomize v5 writes a label set to null
  there as the string "null" instead of deleting it (use a JSON 6902 `remove`).

tests/istio/test_kustomize.py builds every kustomization under istio/ with the real kustomize too
(sigs.k8s.io/kustomize/kustomize/v5, built by scripts/setup.sh) and compares the objects.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
KUSTOMIZATION = "kustomization.yaml"
_KNOWN_KEYS = {"apiVersion", "kind", "resources", "namespace", "labels", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass"}


class KustomizeError(ValueError):
    pass


def _load(path: Path) -> list[Obj]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def build(directory: Path) -> list[Obj]:
    """The objects `kustomize build DIRECTORY` would print (for the supported subset)."""
    directory = Path(directory)
    kfile = directory / KUSTOMIZATION
    if not kfile.is_file():
        raise KustomizeError(f"{directory}: no {KUSTOMIZATION}")
    spec = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(spec) - _KNOWN_KEYS
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported fields {sorted(unknown)} (see meshcache/ctl/istio/kustomize.py)")
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        objects += build(path) if path.is_dir() else _load(path)
    for p in spec.get("patches", []):
        objects = _apply_patch(objects, p, directory)
    for group in spec.get("labels", []):
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(group.get("pairs", {}))
    if "namespace" in spec:
        for obj in objects:
            if obj.get("kind") not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return objects


def _matches(obj: Obj, kind: str | None, name: str | None) -> bool:
    return (kind is None or obj.get("kind") == kind) and (name is None or obj.get("metadata", {}).get("name") == name)


def _apply_patch(objects: list[Obj], entry: Obj, directory: Path) -> list[Obj]:
    if "path" in entry:
        text = (directory / entry["path"]).read_text()
    elif "patch" in entry:
        text = entry["patch"]
    else:
        raise KustomizeError(f"{directory}: a patch needs `path` or `patch`")
    body = yaml.safe_load(text)
    target = entry.get("target", {})
    if isinstance(body, list):
        if not target:
            raise KustomizeError(f"{directory}: a JSON 6902 patch needs a target")
        hits = [o for o in objects if _matches(o, target.get("kind"), target.get("name"))]
        if not hits:
            raise KustomizeError(f"{directory}: patch target {target} matches no object")
        for obj in hits:
            json6902(obj, body)
        return objects
    if target and _has_null(body.get("metadata", {})):
        raise KustomizeError(f"{directory}: a strategic merge patch with a target may not set metadata to null "
                             "(kustomize v5 writes a label as the string \"null\"): use a JSON 6902 remove")
    kind = target.get("kind", body.get("kind"))
    name = target.get("name", body.get("metadata", {}).get("name"))
    hits = [o for o in objects if _matches(o, kind, name)]
    if not hits:
        raise KustomizeError(f"{directory}: patch for {kind}/{name} matches no object")
    if body.get("$patch") == "delete":
        return [o for o in objects if not any(o is h for h in hits)]
    for obj in hits:
        strategic_merge(obj, body)
    return objects


def strategic_merge(base: Obj, patch: Obj) -> Obj:
    """Merge `patch` into `base` in place (see the module docstring for the rules)."""
    for key, value in patch.items():
        if key == "$patch":
            continue
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            strategic_merge(base[key], value)
        elif isinstance(value, list) and isinstance(base.get(key), list) and _named(value) and _named(base[key]):
            by_name = {item["name"]: item for item in base[key]}
            merged = []
            for item in value:
                if item.get("$patch") == "delete":
                    by_name.pop(item["name"], None)
                elif item["name"] in by_name:
                    merged.append(strategic_merge(by_name.pop(item["name"]), item))
                else:
                    merged.append(copy.deepcopy(item))
            base[key] = merged + [i for i in base[key] if i["name"] in by_name]
        else:
            base[key] = copy.deepcopy(value)
    return base


def _has_null(node: Any) -> bool:
    if isinstance(node, dict):
        return any(v is None or _has_null(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_null(v) for v in node)
    return False


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json6902(obj: Obj, ops: list[Obj]) -> Obj:
    """Apply RFC 6902 operations (add/remove/replace/test) to `obj` in place."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            elif kind == "remove":
                node.pop(index)
            elif kind == "replace":
                node[index] = copy.deepcopy(op["value"])
            elif kind == "test" and node[index] != op["value"]:
                raise KustomizeError(f"test failed at {op['path']}")
        else:
            if kind in ("remove", "replace", "test") and last not in node:
                raise KustomizeError(f"{kind}: no value at {op['path']}")
            if kind in ("add", "replace"):
                node[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del node[last]
            elif kind == "test" and node[last] != op["value"]:
                raise KustomizeError(f"test failed at {op['path']}")
        if kind not in ("add", "remove", "replace", "test"):
            raise KustomizeError(f"unsupported JSON 6902 op {kind!r}")
    return obj


def dump(objects: list[Obj]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, width=120)
