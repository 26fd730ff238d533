"""Offline validation of Kubernetes/Istio objects (no cluster, no istioctl here).

- Istio kinds: the `openAPIV3Schema` of each CRD version in Istio's own CRD file, checked with
  `jsonschema`, plus what the API server adds on top of plain JSON Schema: unknown fields are
  errors (structural pruning would silently drop them; `kubectl apply --validate=strict` rejects
  them), and `x-kubernetes-list-type` map/set uniqueness. CEL rules (`x-kubernetes-validations`)
  are not evaluated: the cross-reference checks (`crossref.py`) cover the ones that matter here.
- Core kinds: `kubernetes_validate` in strict mode (unknown fields are errors there too).
- IstioOperator is not in the CRD file (istioctl validates it itself): a small schema for the
  fields meshcache sets, with Istio's enum values, also strict.
- Prometheus Operator kinds (PodMonitor, ServiceMonitor): the models generated from its CRDs
  (PyPI cloudcoil-models-prometheus-operator), types and enums; unknown fields are errors (what
  the model does not keep).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from meshcache.contract.paths import REPO_ROOT, MissingOutsideFile

ISTIO_CRDS_NAME = "istio-1.30.3-crds.yaml"
KUBERNETES_VERSION = "1.37.0"
# Object-level fields the CRD schemas leave to the API server.
_TOP_LEVEL = {"apiVersion", "kind", "metadata"}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def crd_file() -> Path:
    """Istio's CRDs: `$MESHCACHE_ISTIO_CRDS`, else `shared/istio/` next to the repository."""
    override = os.environ.get("MESHCACHE_ISTIO_CRDS")
    path = Path(override) if override else REPO_ROOT.parent / "shared" / "istio" / ISTIO_CRDS_NAME
    if not path.is_file():
        raise MissingOutsideFile(
            f"Istio CRD schemas not found at {path}: get Istio 1.30.3's CRDs (istio/api "
            "kubernetes/customresourcedefinitions.gen.yaml at tag 1.30.3, or `helm show crds istio/base "
            f"--version 1.30.3`) into ../shared/istio/{ISTIO_CRDS_NAME} beside the repository, "
            "or set MESHCACHE_ISTIO_CRDS to its path")
    return path


@lru_cache(maxsize=4)
def crd_schemas(path: Path | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema, for every served version of every CRD."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader: 0.9 MB of YAML
    with open(path or crd_file()) as f:
        for doc in yaml.load_all(f, Loader=loader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if version.get("served"):
                    key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                    out[key] = version["schema"]["openAPIV3Schema"]
    return out


@dataclass
class Report:
    """Errors per object, each prefixed with `Kind/name` so a failure says where."""

    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def object_id(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind', '?')}/{ns}{meta.get('name', '?')}"


# ---- unknown fields and list semantics (what jsonschema alone does not check) ---------------


def _walk(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("x-kubernetes-int-or-string"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, child in value.items():
            if props is not None and key in props:
                _walk(child, props[key], f"{path}.{key}", errors)
            elif isinstance(extra, dict):
                _walk(child, extra, f"{path}.{key}", errors)
            elif extra is None and props is not None:
                errors.append(f"{path}.{key}: unknown field")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        for i, child in enumerate(value):
            _walk(child, items, f"{path}[{i}]", errors)
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen = [tuple(item.get(k) for k in keys) for item in value if isinstance(item, dict)]
            if len(seen) != len(set(seen)):
                errors.append(f"{path}: duplicate entries for list-map keys {keys}")
        elif list_type == "set" and len({repr(v) for v in value}) != len(value):
            errors.append(f"{path}: duplicate entries in a set")


def _metadata_errors(obj: dict[str, Any]) -> list[str]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return ["metadata: required"]
    errors = []
    name = meta.get("name", "")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        errors.append(f"metadata.name: {name!r} is not a DNS-1123 subdomain")
    ns = meta.get("namespace")
    if ns is not None and (not isinstance(ns, str) or len(ns) > 63 or not _DNS_LABEL.match(ns)):
        errors.append(f"metadata.namespace: {ns!r} is not a DNS-1123 label")
    for key, val in (meta.get("labels") or {}).items():
        if not isinstance(val, str) or len(val) > 63 or not _LABEL_VALUE.match(val):
            errors.append(f"metadata.labels.{key}: {val!r} is not a valid label value")
    for key, val in (meta.get("annotations") or {}).items():
        if not isinstance(val, str):
            errors.append(f"metadata.annotations.{key}: must be a string")
    allowed = {"name", "namespace", "labels", "annotations"}
    errors += [f"metadata.{k}: not expected in a manifest" for k in meta if k not in allowed]
    return errors


_VALIDATORS: dict[int, jsonschema.Draft7Validator] = {}


def _crd_validator(key: int, schema: dict[str, Any]) -> jsonschema.Draft7Validator:
    if key not in _VALIDATORS:
        _VALIDATORS[key] = jsonschema.Draft7Validator(schema)
    return _VALIDATORS[key]


def _crd_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    body = {k: v for k, v in obj.items() if k not in _TOP_LEVEL}
    errors = [f"{k}: unknown field" for k in body if k not in schema.get("properties", {})]
    validator = _crd_validator(id(schema), schema)
    for err in sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path) or "(object)"
        errors.append(f"{where}: {err.message}")
    _walk(body, schema, "", errors)
    return [e.lstrip(".") for e in errors] + _metadata_errors(obj)


@lru_cache(maxsize=1)
def _core_definitions() -> Any:
    from referencing import Registry, Resource
    defs = kubernetes_validate.utils.schema_contents(
        f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local-strict/_definitions.json", KUBERNETES_VERSION)
    return Resource.from_contents(defs) @ Registry()


@lru_cache(maxsize=64)
def _core_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """kubernetes-validate's strict schemas for this Kubernetes version, compiled once (its own
    `validate()` reloads the 5 MB definitions on every call)."""
    from referencing import Resource
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    name = f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local-strict/{kind.lower()}-{group_version}.json"
    try:
        schema = kubernetes_validate.utils.schema_contents(name, KUBERNETES_VERSION)
    except FileNotFoundError:
        return None
    registry = Resource.from_contents(schema) @ _core_definitions()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _core_errors(obj: dict[str, Any]) -> list[str]:
    validator = _core_validator(obj["apiVersion"], obj["kind"])
    if validator is None:
        return [f"no Kubernetes {KUBERNETES_VERSION} schema for {obj.get('apiVersion')}/{obj.get('kind')}"]
    errors = [f"{'.'.join(str(p) for p in e.absolute_path) or '(object)'}: {e.message}"
              for e in validator.iter_errors(obj)]
    return errors + _metadata_errors(obj)


# IstioOperator (install.istio.io/v1alpha1): only the parts meshcache uses, enums as in Istio's
# mesh/v1alpha1/config.proto. Anything else in the object is an error, like everywhere else.
_CONFIG_SOURCE = {
    "type": "object", "required": ["address"], "additionalProperties": False,
    "properties": {
        "address": {"type": "string", "pattern": r"^(k8s://|xds://|fs://)[^\s]*$"},
        "subscribedResources": {"type": "array", "items": {"enum": ["SERVICE_REGISTRY"]}},
        "tlsSettings": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "mode": {"enum": ["DISABLE", "SIMPLE", "MUTUAL", "ISTIO_MUTUAL"]},
                "credentialName": {"type": "string"},
                "caCertificates": {"type": "string"},
                "sni": {"type": "string"},
                "subjectAltNames": {"type": "array", "items": {"type": "string"}},
                "insecureSkipVerify": {"type": "boolean"},
            },
        },
    },
}
ISTIO_OPERATOR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "install.istio.io/v1alpha1"},
        "kind": {"const": "IstioOperator"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "profile": {"enum": ["default", "demo", "minimal", "remote", "empty", "preview", "ambient"]},
                "revision": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "meshConfig": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "meshMTLS": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"minProtocolVersion": {"enum": ["TLS_AUTO", "TLSV1_2", "TLSV1_3"]}},
                        },
                        "configSources": {"type": "array", "minItems": 1, "items": _CONFIG_SOURCE},
                        "defaultConfig": {"type": "object"},
                        "accessLogFile": {"type": "string"},
                    },
                },
                "values": {"type": "object"},
            },
        },
    },
}


MONITORING_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "ServiceMonitor")}


def _monitoring_errors(obj: dict[str, Any]) -> list[str]:
    import pydantic
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    model = getattr(monitoring, obj["kind"])
    try:
        parsed = model.model_validate(obj)
    except pydantic.ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    errors: list[str] = []
    _unknown(obj, kept, "", errors)
    return errors + _metadata_errors(obj)


def _unknown(given: Any, kept: Any, path: str, errors: list[str]) -> None:
    """Fields of `given` the model dropped (it ignores unknown ones) are unknown fields."""
    if isinstance(given, dict) and isinstance(kept, dict):
        for k, v in given.items():
            if k not in kept:
                errors.append(f"{path}{k}: unknown field")
            else:
                _unknown(v, kept[k], f"{path}{k}.", errors)
    elif isinstance(given, list) and isinstance(kept, list):
        for i, (g, k) in enumerate(zip(given, kept, strict=False)):
            _unknown(g, k, f"{path}{i}.", errors)


def validate_object(obj: dict[str, Any], crds: dict[tuple[str, str], dict[str, Any]] | None = None) -> list[str]:
    """Errors for one object (empty when valid)."""
    if not isinstance(obj, dict) or "apiVersion" not in obj or "kind" not in obj:
        return ["not a Kubernetes object (apiVersion and kind are required)"]
    key = (obj["apiVersion"], obj["kind"])
    schemas = crds if crds is not None else crd_schemas()
    if key in schemas:
        return _crd_errors(obj, schemas[key])
    if key == ("install.istio.io/v1alpha1", "IstioOperator"):
        v = jsonschema.Draft7Validator(ISTIO_OPERATOR_SCHEMA)
        return [f"{'.'.join(map(str, e.absolute_path)) or '(object)'}: {e.message}" for e in v.iter_errors(obj)]
    if key in MONITORING_KINDS:
        return _monitoring_errors(obj)
    if obj["apiVersion"].endswith(".istio.io/v1alpha1") or ".istio.io/" in obj["apiVersion"]:
        return [f"unknown Istio kind {key}: not served by Istio 1.30"]
    return _core_errors(obj)


def validate_all(objects: Iterable[dict[str, Any]]) -> Report:
    report = Report()
    crds = crd_schemas()
    for obj in objects:
        report.errors += [f"{object_id(obj)}: {e}" for e in validate_object(obj, crds)]
    return report


class ManifestError(ValueError):
    """A manifest path that can't be read as YAML objects (one line, naming the file)."""


def one_line(text: str) -> str:
    """Schema messages may span lines (a repr of the offending value): one line per error."""
    return " ".join(text.split())


def short_id(obj: dict[str, Any]) -> str:
    """`Kind/name`, as the cross-reference checks name objects."""
    return f"{obj.get('kind', '?')}/{(obj.get('metadata') or {}).get('name', '?')}"


def manifest_files(paths: Iterable[Path]) -> list[Path]:
    """The files to validate: each file given, and every *.yaml / *.yml under a directory given."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:
                raise ManifestError(f"{path}: a directory with no *.yaml or *.yml file")
            out += found
        elif path.is_file():
            out.append(path)
        else:
            raise ManifestError(f"{path}: no such file or directory")
    return list(dict.fromkeys(out))


def load_yaml_objects(path: Path) -> list[dict[str, Any]]:
    """The YAML documents in a file that are mappings; ManifestError (one line) when it is no
    readable YAML file."""
    try:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
    except IsADirectoryError as exc:
        raise ManifestError(f"{path}: a directory (`meshcache istio validate DIR` takes every YAML in it)") from exc
    except OSError as exc:
        raise ManifestError(f"{path}: {exc.strerror or exc}") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid YAML: {one_line(str(exc))}") from exc
    for n, d in enumerate(docs, start=1):
        if not isinstance(d, dict):
            raise ManifestError(f"{path}: document {n} is a {type(d).__name__}, not a Kubernetes object")
    return docs
