"""Triton model configuration: `<model>/config.pbtxt` parsed against the subset of Triton's
ModelConfig in proto/model_config.proto, checked for what the engine implements, auto-completed
from the ONNX model, and turned into the engine's own `ModelConfig`.

Every field the engine reads changes what it does; a Triton field it does not implement (in the
subset or not) is refused with an error naming it, never ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from meshcache.contract.protos import model_config_pb2 as mc
from meshcache.engine.tensors import DTYPES

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILENAME = "model.onnx"
PLATFORM, BACKEND = "onnxruntime_onnx", "onnxruntime"
# Triton's onnxruntime backend fills in this max_batch_size when it auto-completes a model whose
# inputs and outputs all have a variable first dimension.
AUTO_MAX_BATCH_SIZE = 4
# max_queue_size 0 means "unbounded" in Triton; the engine keeps every queue bounded.
DEFAULT_MAX_QUEUE_SIZE = 256
MAX_QUEUE_SIZE = 65536
MAX_QUEUE_DELAY_US = 10_000_000
MAX_INSTANCES = 16

# Triton data type name -> KServe v2 datatype name (TYPE_STRING and TYPE_BF16 are not served).
V2_DATATYPE = {f"TYPE_{name}": name for name in DTYPES}
TRITON_DATATYPE = {v: k for k, v in V2_DATATYPE.items()}
_ORT_ELEMENT = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
}
# onnxruntime backend parameters the engine honours.
PARAMETERS = {"intra_op_thread_count"}

# Fields of Triton's ModelConfig messages that proto/model_config.proto leaves out, so that their
# parse error can say "Triton feature the engine does not implement" rather than "no such field".
_TRITON_ONLY = {
    "ModelConfig": {"runtime", "batch_input", "batch_output", "optimization", "sequence_batching",
                    "ensemble_scheduling", "cc_model_filenames", "metric_tags", "model_warmup",
                    "model_operations", "model_transaction_policy", "model_repository_agents",
                    "response_cache", "model_metrics"},
    "ModelInput": {"reshape", "is_shape_tensor", "allow_ragged_batch", "optional", "is_non_linear_format_io"},
    "ModelOutput": {"reshape", "label_filename", "is_shape_tensor", "is_non_linear_format_io"},
    "ModelDynamicBatching": {"preserve_ordering", "priority_queue_policy"},
    "ModelInstanceGroup": {"rate_limiter", "gpus", "secondary_devices", "profile", "passive", "host_policy"},
}
_NO_FIELD = re.compile(r'Message type "inference\.(\w+)" has no field named "(\w+)"')


class ConfigError(ValueError):
    """A model that cannot be served as configured; the message names the file and field."""


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
    """The scheduler: `dynamic` combines queued requests into one run (Triton's dynamic_batching);
    without it each request runs alone, still queued by priority."""

    dynamic: bool = False
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    priority_levels: int = 0
    default_priority_level: int = 0
    timeout_us: int = 0
    allow_timeout_override: bool = False
    delay_on_timeout: bool = False


@dataclass(frozen=True)
class ModelConfig:
    name: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batching: BatchingConfig
    instances: int
    intra_op_threads: int | None
    # The completed Triton config, as the config endpoints return it.
    proto: mc.ModelConfig

    def full_shape(self, spec: TensorSpec) -> list[int]:
        """Shape as clients see it: a leading -1 batch dimension when the model batches."""
        return ([-1] if self.max_batch_size > 0 else []) + list(spec.shape)


def parse_text(text: str, source: str) -> mc.ModelConfig:
    """config.pbtxt -> Triton ModelConfig; unknown or unimplemented fields are errors naming them."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        message = re.sub(r"^\d+:\d+ : ", "", str(exc))
        where = f"{source}:{exc.GetLine()}:{exc.GetColumn()}" if exc.GetLine() is not None else source
        raise ConfigError(f"{where}: {_explain(message)}") from None
    return config


def parse_json(text: str, source: str) -> mc.ModelConfig:
    """A JSON ModelConfig (Triton's load-time `config` override)."""
    config = mc.ModelConfig()
    try:
        json_format.Parse(text, config)
    except json_format.ParseError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc).split(' Available Fields')[0])}") from None
    return config


def _explain(message: str) -> str:
    match = _NO_FIELD.search(message)
    if match is None:
        return message
    owner, field = match.groups()
    if field in _TRITON_ONLY.get(owner, ()):
        return f"{owner} field {field!r} (a Triton feature) is not supported by meshcache-engine; remove it"
    return f"{owner} has no field {field!r} (not in Triton's model configuration either)"


def to_text(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def to_json(message: Message) -> dict[str, Any]:
    """Triton's JSON form of a config: proto field names, enum names, int64 as numbers (Triton
    rewrites protobuf's int64 strings), scalars shown even at their default, unset messages left out."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _json_value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_json_value(field, v) for v in value]
        elif field.message_type is not None:
            if message.HasField(field.name):
                out[field.name] = to_json(value)
        else:
            out[field.name] = _json_value(field, value)
    return out


def _json_value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        return to_json(value)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    return value


def validate(config: mc.ModelConfig, model_name: str, source: str) -> None:
    """Checks every field against what the engine implements (before any model file is read)."""

    def fail(message: str) -> ConfigError:
        return ConfigError(f"{source}: {message}")

    if config.name and config.name != model_name:
        raise fail(f"name {config.name!r} differs from the model directory {model_name!r}")
    if config.platform not in ("", PLATFORM):
        raise fail(f"platform {config.platform!r} is not supported; meshcache-engine serves ONNX models "
                   f"(platform {PLATFORM!r}, backend {BACKEND!r})")
    if config.backend not in ("", BACKEND):
        raise fail(f"backend {config.backend!r} is not supported; meshcache-engine serves ONNX models "
                   f"on onnxruntime (backend {BACKEND!r})")
    if config.max_batch_size < 0:
        raise fail(f"max_batch_size must be >= 0, got {config.max_batch_size}")
    if "/" in config.default_model_filename or config.default_model_filename in (".", ".."):
        raise fail(f"default_model_filename {config.default_model_filename!r} must be a file name")
    for what, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for tensor in tensors:
            if not tensor.name:
                raise fail(f"every {what} needs a name")
            if tensor.name in seen:
                raise fail(f"{what} {tensor.name!r} is listed twice")
            seen.add(tensor.name)
            type_name = mc.DataType.Name(tensor.data_type)
            if type_name not in V2_DATATYPE:
                raise fail(f"{what} {tensor.name!r}: data_type {type_name} is not supported; "
                           f"supported: {', '.join(V2_DATATYPE)}")
            if any(d < -1 or d == 0 for d in tensor.dims):
                raise fail(f"{what} {tensor.name!r}: dims {list(tensor.dims)} must be positive or -1")
    _validate_batching(config, fail)
    _validate_versions(config, fail)
    for group in config.instance_group:
        kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
        if kind not in ("KIND_AUTO", "KIND_CPU"):
            raise fail(f"instance_group kind {kind} is not supported; the engine runs on CPU (KIND_CPU)")
        if group.count < 0:
            raise fail(f"instance_group count must be >= 0, got {group.count}")
    if _instance_count(config) > MAX_INSTANCES:
        raise fail(f"instance_group counts add up to more than {MAX_INSTANCES}")
    for key, param in config.parameters.items():
        if key not in PARAMETERS:
            raise fail(f"parameters key {key!r} is not supported; supported: {', '.join(sorted(PARAMETERS))}")
        if not param.string_value.isdigit() or int(param.string_value) > 64:
            raise fail(f"parameters {key!r} must be an integer 0..64, got {param.string_value!r}")


def _validate_batching(config: mc.ModelConfig, fail: Any) -> None:
    if not config.HasField("dynamic_batching"):
        return
    db = config.dynamic_batching
    for size in db.preferred_batch_size:
        if not 1 <= size <= max(config.max_batch_size, 1):
            raise fail(f"dynamic_batching preferred_batch_size {size} must lie in 1..max_batch_size "
                       f"({config.max_batch_size})")
    if db.max_queue_delay_microseconds > MAX_QUEUE_DELAY_US:
        raise fail(f"dynamic_batching max_queue_delay_microseconds must be <= {MAX_QUEUE_DELAY_US}")
    if db.priority_levels > 2**31:
        raise fail("dynamic_batching priority_levels is too large")
    if db.priority_levels == 0 and db.default_priority_level != 0:
        raise fail("dynamic_batching default_priority_level needs priority_levels")
    if db.priority_levels and not 1 <= db.default_priority_level <= db.priority_levels:
        raise fail(f"dynamic_batching default_priority_level must lie in 1..priority_levels "
                   f"({db.priority_levels}), got {db.default_priority_level}")
    policy = db.default_queue_policy
    if policy.max_queue_size > MAX_QUEUE_SIZE:
        raise fail(f"dynamic_batching default_queue_policy max_queue_size must be <= {MAX_QUEUE_SIZE}")
    if policy.default_timeout_microseconds > 2**53:
        raise fail("dynamic_batching default_queue_policy default_timeout_microseconds is too large")


def _validate_versions(config: mc.ModelConfig, fail: Any) -> None:
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "latest" and policy.latest.num_versions < 1:
        raise fail("version_policy latest num_versions must be >= 1")
    if choice == "specific":
        if not policy.specific.versions:
            raise fail("version_policy specific needs at least one version")
        if any(v < 1 for v in policy.specific.versions):
            raise fail(f"version_policy specific versions must be positive, got {list(policy.specific.versions)}")


def _instance_count(config: mc.ModelConfig) -> int:
    return sum(g.count or 1 for g in config.instance_group) or 1


def select_versions(config: mc.ModelConfig, available: list[int], source: str) -> list[int]:
    """The versions the policy serves, ascending (Triton's default: the latest one)."""
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        chosen = sorted(available)
    elif choice == "specific":
        missing = sorted(set(policy.specific.versions) - set(available))
        if missing:
            raise ConfigError(f"{source}: version_policy specific versions {missing} have no "
                              f"<version>/{config.default_model_filename or DEFAULT_MODEL_FILENAME}")
        chosen = sorted(set(policy.specific.versions))
    else:
        count = policy.latest.num_versions if choice == "latest" else 1
        chosen = sorted(available)[-count:]
    if not chosen:
        raise ConfigError(f"{source}: no <version>/{config.default_model_filename or DEFAULT_MODEL_FILENAME} found")
    return chosen


@dataclass(frozen=True)
class GraphTensor:
    name: str
    datatype: str | None  # None: an element type the engine cannot serve
    # None for symbolic or unknown dimensions.
    shape: tuple[int | None, ...]


def complete(config: mc.ModelConfig, model_name: str, inputs: list[GraphTensor],
             outputs: list[GraphTensor]) -> mc.ModelConfig:
    """Triton's auto-complete: fill what the config leaves out from the ONNX graph."""
    done = mc.ModelConfig()
    done.CopyFrom(config)
    done.name = model_name
    done.platform, done.backend = PLATFORM, BACKEND
    if not done.default_model_filename:
        done.default_model_filename = DEFAULT_MODEL_FILENAME
    if not done.HasField("version_policy"):
        done.version_policy.latest.num_versions = 1
    batch_dim = all(t.shape and t.shape[0] is None for t in inputs + outputs)
    if not done.input and not done.output and done.max_batch_size == 0 and batch_dim:
        done.max_batch_size = AUTO_MAX_BATCH_SIZE
        if not done.HasField("dynamic_batching"):
            done.dynamic_batching.SetInParent()
    skip = 1 if done.max_batch_size > 0 else 0
    for have, graph, kind in ((done.input, inputs, mc.ModelInput), (done.output, outputs, mc.ModelOutput)):
        if have:
            continue
        for t in graph:
            if t.datatype is None:
                continue  # validate() against the graph names it
            have.append(kind(name=t.name, data_type=mc.DataType.Value(TRITON_DATATYPE[t.datatype]),
                             dims=[-1 if d is None else d for d in t.shape[skip:]]))
    if not done.instance_group:
        done.instance_group.add(name=model_name, count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    else:
        for i, group in enumerate(done.instance_group):
            group.count = group.count or 1
            group.kind = mc.ModelInstanceGroup.KIND_CPU
            group.name = group.name or f"{model_name}_{i}"
    return done


def check_against_graph(config: mc.ModelConfig, inputs: list[GraphTensor], outputs: list[GraphTensor],
                        source: str) -> None:
    """The completed config must describe the graph: every graph input, types and dims."""
    skip = 1 if config.max_batch_size > 0 else 0
    for what, declared, graph in (("input", config.input, inputs), ("output", config.output, outputs)):
        by_name = {t.name: t for t in graph}
        for tensor in declared:
            g = by_name.get(tensor.name)
            if g is None:
                raise ConfigError(f"{source}: {what} {tensor.name!r} is not in the ONNX graph; graph "
                                  f"{what}s: {', '.join(by_name)}")
            want = V2_DATATYPE[mc.DataType.Name(tensor.data_type)]
            if g.datatype != want:
                raise ConfigError(f"{source}: {what} {tensor.name!r} is {g.datatype or 'an unsupported type'} "
                                  f"in the ONNX graph, config says {mc.DataType.Name(tensor.data_type)}")
            if skip and g.shape and g.shape[0] is not None:
                raise ConfigError(f"{source}: {what} {tensor.name!r} has a fixed first dimension "
                                  f"{g.shape[0]} in the ONNX graph, so the model cannot batch; set "
                                  f"max_batch_size 0")
            graph_dims = g.shape[skip:]
            ok = len(graph_dims) == len(tensor.dims) and all(
                gd is None or d == gd or (d == -1 and gd is None) for d, gd in zip(tensor.dims, graph_dims,
                                                                                  strict=True))
            if g.shape and not ok:
                raise ConfigError(f"{source}: {what} {tensor.name!r} dims {list(tensor.dims)} do not match the "
                                  f"ONNX graph's {['?' if d is None else d for d in graph_dims]}")
    missing = sorted({t.name for t in inputs} - {t.name for t in config.input})
    if missing:
        raise ConfigError(f"{source}: ONNX graph inputs {missing} are missing from the config")


def to_engine_config(config: mc.ModelConfig) -> ModelConfig:
    """The completed, checked Triton config -> what the engine runs with."""
    def specs(tensors: Any) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t.name, V2_DATATYPE[mc.DataType.Name(t.data_type)], tuple(t.dims))
                     for t in tensors)

    batching = BatchingConfig()
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        policy = db.default_queue_policy
        batching = BatchingConfig(
            dynamic=config.max_batch_size > 0,
            max_queue_delay_us=db.max_queue_delay_microseconds,
            preferred_batch_sizes=tuple(sorted(db.preferred_batch_size)),
            max_queue_size=policy.max_queue_size or DEFAULT_MAX_QUEUE_SIZE,
            priority_levels=db.priority_levels,
            default_priority_level=db.default_priority_level,
            timeout_us=policy.default_timeout_microseconds,
            allow_timeout_override=policy.allow_timeout_override,
            delay_on_timeout=policy.timeout_action == mc.ModelQueuePolicy.DELAY,
        )
    threads = config.parameters.get("intra_op_thread_count")
    return ModelConfig(
        name=config.name,
        platform=config.platform,
        max_batch_size=config.max_batch_size,
        inputs=specs(config.input),
        outputs=specs(config.output),
        batching=batching,
        instances=_instance_count(config),
        intra_op_threads=int(threads.string_value) or None if threads is not None else None,
        proto=config,
    )


def graph_tensors(args: list[Any]) -> list[GraphTensor]:
    """onnxruntime NodeArgs -> GraphTensor (symbolic dimensions become None)."""
    return [GraphTensor(a.name, _ORT_ELEMENT.get(a.type),
                        tuple(d if isinstance(d, int) and d > 0 else None for d in (a.shape or [])))
            for a in args]
