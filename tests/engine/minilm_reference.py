"""A numpy forward pass of all-MiniLM-L6-v2 (BERT encoder, mean pooling, L2 norm), written from the
architecture (Devlin et al.; sentence-transformers' pooling config) and independent of the ONNX
graph in engine/llm_models.py: the reference the engine's embeddings are checked against."""

from __future__ import annotations

import math

import numpy as np

HEADS, LAYERS, EPS = 12, 6, 1e-12


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * gamma + beta


def _linear(x: np.ndarray, w: dict[str, np.ndarray], name: str) -> np.ndarray:
    return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]


def _gelu(x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def embed(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """One sentence's token ids (with [CLS]/[SEP]) -> its unit-norm embedding, in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    n = len(ids)
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
    d = x.shape[1] // HEADS
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        q, k, v = (_linear(x, w, f"{p}.attention.self.{m}").reshape(n, HEADS, d).transpose(1, 0, 2)
                   for m in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        attn = attn.transpose(1, 0, 2).reshape(n, HEADS * d)
        x = _layer_norm(_linear(attn, w, f"{p}.attention.output.dense") + x,
                        w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"])
        h = _gelu(_linear(x, w, f"{p}.intermediate.dense"))
        x = _layer_norm(_linear(h, w, f"{p}.output.dense") + x,
                        w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"])
    pooled = x.mean(0)
    return pooled / np.linalg.norm(pooled)
