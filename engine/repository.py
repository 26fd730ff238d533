"""The model repository, laid out as Triton's: DIR/<model>/config.pbtxt (optional: auto-completed
from the ONNX model when absent) plus DIR/<model>/<version>/model.onnx, loaded into onnxruntime
sessions. Models can be (re)loaded and unloaded while the engine runs (engine/service.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from meshcache.contract.protos import model_config_pb2 as mc
from meshcache.engine import model_config
from meshcache.engine.errors import NotFound
from meshcache.engine.model_config import CONFIG_FILE, ConfigError, ModelConfig, TensorSpec
from meshcache.engine.statistics import ModelStats

__all__ = ["ConfigError", "LoadedModel", "ModelConfig", "ModelEntry", "ModelRepository", "TensorSpec"]


def new_session(path: Path, intra_op_threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    # One thread per session by default: the answers stay byte-identical whatever the batch
    # size (tests check it), and the other core serves the network side.
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types for unreadable models
        raise ConfigError(f"{path}: onnxruntime cannot load it: {exc}") from None


class LoadedModel:
    """One version of one model, with its onnxruntime session and its Triton statistics."""

    def __init__(self, config: ModelConfig, version: str, session: ort.InferenceSession) -> None:
        self.config = config
        self.version = version
        self.session = session
        self.output_names = [o.name for o in config.outputs]
        self.stats = ModelStats()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds), strict=True))


@dataclass
class ModelEntry:
    config: ModelConfig
    versions: dict[str, LoadedModel]
    # Requests without a version get the highest one served (as Triton does).
    default_version: str

    def sorted_versions(self) -> list[str]:
        return sorted(self.versions, key=int)


def read_model(directory: Path, name: str, intra_op_threads: int,
               override: mc.ModelConfig | None = None) -> ModelEntry:
    """Parse, check and load one model directory (blocking: builds onnxruntime sessions)."""
    model_dir = directory / name
    if not model_dir.is_dir():
        raise NotFound(f"model {name!r} is not in the repository {directory}")
    config_path = model_dir / CONFIG_FILE
    if override is not None:
        source, config = f"{name}: load 'config'", override
    elif config_path.exists():
        source = str(config_path)
        try:
            text = config_path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_path}: cannot read it: {exc}") from None
        config = model_config.parse_text(text, source)
    elif (model_dir / "config.json").exists():
        raise ConfigError(f"{model_dir}: config.json is not read; write the configuration as {CONFIG_FILE} "
                          f"(Triton's model configuration, protobuf text format) or leave it out to "
                          f"auto-complete it from the ONNX model")
    else:
        source, config = f"{model_dir} (no {CONFIG_FILE}: auto-completed)", mc.ModelConfig()
    model_config.validate(config, name, source)
    filename = config.default_model_filename or model_config.DEFAULT_MODEL_FILENAME
    available = [int(v.name) for v in model_dir.iterdir()
                 if v.is_dir() and v.name.isdigit() and int(v.name) > 0 and (v / filename).is_file()]
    versions = model_config.select_versions(config, available, source)
    threads = config.parameters.get("intra_op_thread_count")
    intra = int(threads.string_value) if threads is not None and int(threads.string_value) else intra_op_threads
    sessions = {str(v): new_session(model_dir / str(v) / filename, intra) for v in versions}
    latest = sessions[str(versions[-1])]
    completed = model_config.complete(config, name, model_config.graph_tensors(latest.get_inputs()),
                                      model_config.graph_tensors(latest.get_outputs()))
    for version, session in sessions.items():
        model_config.check_against_graph(
            completed, model_config.graph_tensors(session.get_inputs()),
            model_config.graph_tensors(session.get_outputs()), f"{source} (version {version})")
    engine_config = model_config.to_engine_config(completed)
    loaded = {v: LoadedModel(engine_config, v, s) for v, s in sessions.items()}
    return ModelEntry(engine_config, loaded, default_version=str(versions[-1]))


class ModelRepository:
    """The models being served, and why the others in the directory are not."""

    def __init__(self, directory: Path, intra_op_threads: int, models: dict[str, ModelEntry]) -> None:
        self.directory = directory
        self.intra_op_threads = intra_op_threads
        self.models = models
        # Model name -> why it is not served (failed load, unloaded).
        self.unavailable: dict[str, str] = {}

    @classmethod
    def load(cls, directory: Path, intra_op_threads: int = 1) -> ModelRepository:
        """Every model in the directory, at startup: any error stops the engine."""
        if not directory.is_dir():
            raise ConfigError(f"model repository {directory} is not a directory")
        models = {name: read_model(directory, name, intra_op_threads) for name in cls.names_on_disk(directory)}
        if not models:
            raise ConfigError(f"model repository {directory} has no models")
        return cls(directory, intra_op_threads, models)

    @staticmethod
    def names_on_disk(directory: Path) -> list[str]:
        return sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))

    def read(self, name: str, override: mc.ModelConfig | None = None) -> ModelEntry:
        if not name or name.startswith(".") or "/" in name or name != Path(name).name:
            raise NotFound(f"model name {name!r} is not a directory name")
        return read_model(self.directory, name, self.intra_op_threads, override)

    def entry(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            reason = self.unavailable.get(name)
            raise NotFound(f"unknown model {name!r}" if reason is None
                           else f"model {name!r} is not available: {reason}") from None

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
