"""The demo model repository: small ONNX models built from fixed seeds, identical on every machine.

Each model is written in Triton's repository layout: DIR/<model>/<version>/model.onnx plus
DIR/<model>/config.pbtxt (Triton's model configuration in protobuf text format). Weights come
from numpy's PCG64 generator with fixed seeds and the graphs from the `onnx` helper API, so no
downloads are needed and two machines produce byte-identical files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf import json_format
from onnx import TensorProto, helper, numpy_helper

from meshcache.contract.protos import model_config_pb2 as mc
from meshcache.engine.demo_stamp import STAMP_FILE, stamp
from meshcache.engine.model_config import CONFIG_FILE, to_text

# Pinned so the files do not change when the onnx package is upgraded; onnxruntime 1.x reads it.
OPSET = 17
IR_VERSION = 8


class _GraphBuilder:
    """Accumulates nodes and seeded initializers; names are generated so graphs stay readable."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def weight(self, shape: tuple[int, ...], scale: float) -> str:
        name = self._name("w")
        values = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        self.initializers.append(numpy_helper.from_array(values, name))
        return name

    def const(self, values: np.ndarray) -> str:
        name = self._name("c")
        self.initializers.append(numpy_helper.from_array(values, name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        out = self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def dense(self, x: str, n_in: int, n_out: int) -> str:
        w = self.weight((n_in, n_out), scale=(2.0 / n_in) ** 0.5)
        b = self.weight((n_out,), scale=0.1)
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def conv(self, x: str, c_in: int, c_out: int, kernel: int, stride: int = 1) -> str:
        w = self.weight((c_out, c_in, kernel, kernel), scale=(2.0 / (c_in * kernel * kernel)) ** 0.5)
        b = self.weight((c_out,), scale=0.05)
        pad = kernel // 2
        return self.op("Conv", [x, w, b], strides=[stride, stride], pads=[pad, pad, pad, pad])

    def model(
        self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[tuple[str, str, list[Any]]]
    ) -> onnx.ModelProto:
        # The last op outputs get renamed to the public output names via Identity nodes.
        out_infos = []
        for src, public, shape in outputs:
            self.nodes.append(helper.make_node("Identity", [src], [public]))
            out_infos.append(helper.make_tensor_value_info(public, TensorProto.FLOAT, shape))
        graph = helper.make_graph(self.nodes, name, inputs, out_infos, initializer=self.initializers)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="meshcache"
        )
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model)
        return model


def mlp_classifier(seed: int) -> onnx.ModelProto:
    """16 features -> 64 -> 32 -> 4 class probabilities."""
    g = _GraphBuilder(seed)
    h = g.op("Relu", [g.dense("input", 16, 64)])
    h = g.op("Relu", [g.dense(h, 64, 32)])
    probs = g.op("Softmax", [g.dense(h, 32, 4)], axis=-1)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 16])
    return g.model("mlp-classifier", [x], [(probs, "probabilities", ["batch", 4])])


def resnet_mini(seed: int) -> onnx.ModelProto:
    """A small ResNet for 3x32x32 NCHW images with a VGG-style classifier: 9.1M parameters (36 MB).

    Trunk: stride-2 3x3 stem, then ResNet-18's layout of four stages x two basic blocks (32, 64,
    128, 256 channels; 16x16 down to 2x2; 2.8M parameters). Head: the 2x2x256 map flattened into
    two 2048-wide fully connected layers, then 10 logits (6.3M parameters). The head holds most of
    the weights on purpose: on a CPU, onnxruntime runs convolutions one image at a time, so they
    cost about the same per row at any batch size (a plain ResNet with a pooled single-layer head
    measured 0.8-1.4x per row at batch 16 vs 1), while a fully connected layer reads its weights
    once per batch. That weight traffic is what dynamic batching amortises (bench/engine.py).
    """
    g = _GraphBuilder(seed)
    h = g.op("Relu", [g.conv("image", 3, 32, 3, stride=2)])

    def block(x: str, c_in: int, c_out: int, stride: int) -> str:
        y = g.op("Relu", [g.conv(x, c_in, c_out, 3, stride)])
        y = g.conv(y, c_out, c_out, 3)
        shortcut = x if (c_in == c_out and stride == 1) else g.conv(x, c_in, c_out, 1, stride)
        return g.op("Relu", [g.op("Add", [y, shortcut])])

    channels = 32
    for width, stride in [(32, 1), (64, 2), (128, 2), (256, 2)]:
        h = block(h, channels, width, stride)
        h = block(h, width, width, 1)
        channels = width
    # Flatten rather than GlobalAveragePool: keeps the spatial layout for the classifier, as VGG does.
    features = g.op("Flatten", [h], axis=1)
    hidden = g.op("Relu", [g.dense(features, channels * 2 * 2, 2048)])
    hidden = g.op("Relu", [g.dense(hidden, 2048, 2048)])
    logits = g.dense(hidden, 2048, 10)
    x = helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])
    return g.model("resnet-mini", [x], [(logits, "logits", ["batch", 10])])


def text_embedder(seed: int, vocab: int = 1000, dim: int = 32) -> onnx.ModelProto:
    """Token ids [batch, seq] -> mean-pooled embedding -> projection -> L2-normalised [batch, 32]."""
    g = _GraphBuilder(seed)
    table = g.weight((vocab, dim), scale=1.0)
    # Ids outside the vocabulary would make Gather fail; Mod keeps every int64 id in range.
    ids = g.op("Mod", ["token_ids", g.const(np.array(vocab, dtype=np.int64))], fmod=0)
    ids = g.op("Abs", [ids])
    emb = g.op("Gather", [table, ids], axis=0)
    # Pooling and the norm are MatMuls, not ReduceMean/ReduceSum: onnxruntime's reductions pick a
    # different summation order for batch 1 than for batch N, which would make batched answers
    # differ in the last bits from unbatched ones. A batched MatMul computes each row alike.
    seq = g.op("Slice", [g.op("Shape", ["token_ids"]), g.const(np.array([1], dtype=np.int64)),
                         g.const(np.array([2], dtype=np.int64))])
    ones = g.op("ConstantOfShape", [g.op("Concat", [g.const(np.array([1], dtype=np.int64)), seq], axis=0)],
                value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]))
    summed = g.op("Squeeze", [g.op("MatMul", [ones, emb]), g.const(np.array([1], dtype=np.int64))])
    pooled = g.op("Div", [summed, g.op("Cast", [seq], to=TensorProto.FLOAT)])
    h = g.op("Tanh", [g.dense(pooled, dim, dim)])
    sq_norm = g.op("MatMul", [g.op("Mul", [h, h]), g.const(np.ones((dim, 1), dtype=np.float32))])
    norm = g.op("Sqrt", [g.op("Add", [sq_norm, g.const(np.array(1e-12, dtype=np.float32))])])
    out = g.op("Div", [h, norm])
    x = helper.make_tensor_value_info("token_ids", TensorProto.INT64, ["batch", "seq"])
    return g.model("text-embedder", [x], [(out, "embedding", ["batch", dim])])


def _batching(max_queue_delay_us: int, preferred: list[int]) -> dict[str, Any]:
    return {
        "max_queue_delay_microseconds": max_queue_delay_us, "preferred_batch_size": preferred,
        "default_queue_policy": {"max_queue_size": 256},
    }


def _tensor(name: str, data_type: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "data_type": data_type, "dims": dims}


# name -> (builder per version seed, Triton ModelConfig in its JSON form, written as config.pbtxt).
# Dims exclude the batch dimension, as Triton's do when max_batch_size > 0. Requests without a
# version get the highest version served.
DEMO_MODELS: dict[str, tuple[Callable[[int], onnx.ModelProto], dict[int, int], dict[str, Any]]] = {
    "mlp-classifier": (mlp_classifier, {1: 101, 2: 102}, {
        "platform": "onnxruntime_onnx",
        "max_batch_size": 32,
        "version_policy": {"all": {}},
        "input": [_tensor("input", "TYPE_FP32", [16])],
        "output": [_tensor("probabilities", "TYPE_FP32", [4])],
        "dynamic_batching": _batching(500, [8, 16, 32]),
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }),
    "resnet-mini": (resnet_mini, {1: 201}, {
        "platform": "onnxruntime_onnx",
        "max_batch_size": 16,
        "input": [_tensor("image", "TYPE_FP32", [3, 32, 32])],
        "output": [_tensor("logits", "TYPE_FP32", [10])],
        "dynamic_batching": _batching(1000, [4, 8, 16]),
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }),
    "text-embedder": (text_embedder, {1: 301}, {
        "platform": "onnxruntime_onnx",
        "max_batch_size": 16,
        "input": [_tensor("token_ids", "TYPE_INT64", [-1])],
        "output": [_tensor("embedding", "TYPE_FP32", [32])],
        "dynamic_batching": _batching(500, [8, 16]),
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }),
}


def demo_config(name: str, **changes: Any) -> mc.ModelConfig:
    """A demo model's Triton config (with top-level fields replaced by `changes`)."""
    return json_format.ParseDict({"name": name, **DEMO_MODELS[name][2], **changes}, mc.ModelConfig())


def write_demo_models(directory: Path, serve_versions: dict[str, int] | None = None, llm: bool = False) -> list[str]:
    """Write every demo model into `directory` (overwriting) and the version stamp; returns the model
    names. `serve_versions` (model -> version) makes a model serve only that version (Triton's
    version_policy `specific`; the other versions stay on disk), as a canary repository does.
    `llm` adds the OpenAI-served models of engine/llm_models.py (their weights come from a package)."""
    serve = dict(serve_versions or {})
    for name, version in serve.items():
        if name not in DEMO_MODELS or version not in DEMO_MODELS[name][1]:
            known = {n: sorted(v[1]) for n, v in DEMO_MODELS.items()}
            raise ValueError(f"no demo model {name!r} version {version}; the demo models are {known}")
    for name, (build, versions, _) in DEMO_MODELS.items():
        model_dir = directory / name
        for version, seed in versions.items():
            path = model_dir / str(version) / "model.onnx"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(build(seed).SerializeToString(deterministic=True))
        changes = {"version_policy": {"specific": {"versions": [serve[name]]}}} if name in serve else {}
        (model_dir / CONFIG_FILE).write_text(to_text(demo_config(name, **changes)))
    names = list(DEMO_MODELS)
    if llm:
        from meshcache.engine.llm_models import write_llm_models  # imports this module

        names += write_llm_models(directory)
    (directory / STAMP_FILE).write_text(stamp(serve, llm) + "\n")
    return names
