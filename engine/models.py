"""The model repository: DIR/<model>/config.json plus DIR/<model>/<version>/model.onnx, loaded into
onnxruntime sessions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.errors import NotFound
from engine.tensors import DTYPES

# onnxruntime's element type names for each v2 datatype, to check configs against the ONNX graphs.
_ORT_TYPES = {
    "BOOL": "tensor(bool)", "UINT8": "tensor(uint8)", "UINT16": "tensor(uint16)",
    "UINT32": "tensor(uint32)", "UINT64": "tensor(uint64)", "INT8": "tensor(int8)",
    "INT16": "tensor(int16)", "INT32": "tensor(int32)", "INT64": "tensor(int64)",
    "FP16": "tensor(float16)", "FP32": "tensor(float)", "FP64": "tensor(double)",
}


class ConfigError(ValueError):
    """A model directory that cannot be served; raised at startup, never per request."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    # Excludes the batch dimension when the model batches; -1 is any size.
    shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype[Any]:
        return DTYPES[self.datatype]


@dataclass(frozen=True)
class BatchingConfig:
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    # Requests waiting per model version; beyond it requests are refused at once.
    max_queue_size: int = 256


@dataclass(frozen=True)
class ModelConfig:
    name: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batching: BatchingConfig
    default_version: str | None

    def full_shape(self, spec: TensorSpec) -> list[int]:
        """Shape as clients see it: a leading -1 batch dimension when the model batches."""
        return ([-1] if self.max_batch_size > 0 else []) + list(spec.shape)


def _tensor_specs(raw: Any, what: str, model: str) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{model}: config '{what}' must be a non-empty list")
    specs = []
    for item in raw:
        try:
            name, datatype, shape = item["name"], item["datatype"], item["shape"]
        except (KeyError, TypeError):
            raise ConfigError(f"{model}: each of '{what}' needs name, datatype and shape") from None
        if datatype not in DTYPES:
            raise ConfigError(f"{model}: {what} {name!r} has unsupported datatype {datatype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= -1 for d in shape):
            raise ConfigError(f"{model}: {what} {name!r} has an invalid shape {shape!r}")
        specs.append(TensorSpec(str(name), datatype, tuple(shape)))
    return tuple(specs)


def parse_config(raw: dict[str, Any], model_name: str) -> ModelConfig:
    if raw.get("name", model_name) != model_name:
        raise ConfigError(f"{model_name}: config name {raw.get('name')!r} differs from its directory")
    max_batch_size = raw.get("max_batch_size", 0)
    if not isinstance(max_batch_size, int) or max_batch_size < 0:
        raise ConfigError(f"{model_name}: max_batch_size must be a non-negative integer")
    db = raw.get("dynamic_batching") or {}
    batching = BatchingConfig(
        max_queue_delay_us=int(db.get("max_queue_delay_us", 0)),
        preferred_batch_sizes=tuple(sorted(int(s) for s in db.get("preferred_batch_sizes", []))),
        max_queue_size=int(db.get("max_queue_size", 256)),
    )
    if batching.max_queue_delay_us < 0 or batching.max_queue_size < 1:
        raise ConfigError(f"{model_name}: max_queue_delay_us must be >= 0 and max_queue_size >= 1")
    if any(s < 1 or s > max(max_batch_size, 1) for s in batching.preferred_batch_sizes):
        raise ConfigError(f"{model_name}: preferred_batch_sizes must lie in 1..max_batch_size")
    default = raw.get("default_version")
    return ModelConfig(
        name=model_name,
        platform=str(raw.get("platform", "onnxruntime_onnx")),
        max_batch_size=max_batch_size,
        inputs=_tensor_specs(raw.get("inputs"), "inputs", model_name),
        outputs=_tensor_specs(raw.get("outputs"), "outputs", model_name),
        batching=batching,
        default_version=None if default is None else str(default),
    )


class LoadedModel:
    """One version of one model, with its onnxruntime session."""

    def __init__(self, config: ModelConfig, version: str, path: Path, intra_op_threads: int) -> None:
        self.config = config
        self.version = version
        options = ort.SessionOptions()
        # One thread per session by default: the answers stay byte-identical whatever the batch
        # size (tests check it), and the other core serves the network side.
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._check_against_graph(path)
        self.output_names = [o.name for o in config.outputs]

    def _check_against_graph(self, path: Path) -> None:
        graph_inputs = {i.name: i.type for i in self.session.get_inputs()}
        graph_outputs = {o.name: o.type for o in self.session.get_outputs()}
        for spec, graph, what in [(s, graph_inputs, "input") for s in self.config.inputs] + [
            (s, graph_outputs, "output") for s in self.config.outputs
        ]:
            if spec.name not in graph:
                raise ConfigError(f"{path}: config {what} {spec.name!r} is not in the ONNX graph")
            if graph[spec.name] != _ORT_TYPES[spec.datatype]:
                raise ConfigError(
                    f"{path}: {what} {spec.name!r} is {graph[spec.name]}, config says {spec.datatype}"
                )
        if set(graph_inputs) != {s.name for s in self.config.inputs}:
            raise ConfigError(f"{path}: config inputs {sorted(graph_inputs)} must all be listed")

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds), strict=True))


@dataclass
class ModelEntry:
    config: ModelConfig
    versions: dict[str, LoadedModel]
    default_version: str

    def sorted_versions(self) -> list[str]:
        return sorted(self.versions, key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v))


class ModelRepository:
    """Every model in the repository directory, loaded at startup."""

    def __init__(self, models: dict[str, ModelEntry]) -> None:
        self.models = models

    @classmethod
    def load(cls, directory: Path, intra_op_threads: int = 1) -> ModelRepository:
        if not directory.is_dir():
            raise ConfigError(f"model repository {directory} is not a directory")
        models: dict[str, ModelEntry] = {}
        for model_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
            config_path = model_dir / "config.json"
            if not config_path.exists():
                raise ConfigError(f"{model_dir}: config.json is missing")
            try:
                raw = json.loads(config_path.read_text())
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{config_path}: not valid JSON: {exc}") from None
            config = parse_config(raw, model_dir.name)
            versions = {
                v.name: LoadedModel(config, v.name, v / "model.onnx", intra_op_threads)
                for v in sorted(model_dir.iterdir())
                if v.is_dir() and (v / "model.onnx").exists()
            }
            if not versions:
                raise ConfigError(f"{model_dir}: no <version>/model.onnx found")
            entry = ModelEntry(config, versions, default_version="")
            default = config.default_version or entry.sorted_versions()[-1]
            if default not in versions:
                raise ConfigError(f"{model_dir}: default_version {default!r} has no model.onnx")
            entry.default_version = default
            models[model_dir.name] = entry
        if not models:
            raise ConfigError(f"model repository {directory} has no models")
        return cls(models)

    def entry(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            raise NotFound(f"unknown model {name!r}") from None

    def get(self, name: str, version: str = "") -> LoadedModel:
        entry = self.entry(name)
        version = version or entry.default_version
        try:
            return entry.versions[version]
        except KeyError:
            raise NotFound(
                f"model {name!r} has no version {version!r}; versions: {', '.join(entry.sorted_versions())}"
            ) from None

    def all_models(self) -> list[LoadedModel]:
        return [m for entry in self.models.values() for m in entry.versions.values()]
