"""The models the OpenAI-compatible endpoints serve, and what they need besides the ONNX graph: a
tokenizer, the chat prompt template and sampling.

A repository model is served on /v1/* when its directory holds `openai.json` (written by
engine/llm_models.py) next to config.pbtxt:
  {"kind": "generation", "context": 8, "eos_token_id": 102, "tokenizer": "tokenizer.json",
   "aliases": ["llama3-70b-demo"]}
  {"kind": "embedding", "max_input_tokens": 256, "tokenizer": "tokenizer.json"}
It is served under its directory's name and each of its `aliases` (the same model; an answer's
`model` is the name asked for).
A generation model takes `context` [batch, N] token ids (left-padded with 0) and returns `logits`
[batch, vocab] for the next token; an embedding model takes `input_ids` and `attention_mask`
[batch, seq] and returns `embedding` [batch, dim]. Both run through the engine's batchers, so
their requests share the statistics, metrics and draining of KServe v2 requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from meshcache.engine.model_config import ConfigError

OPENAI_FILE = "openai.json"
KINDS = ("generation", "embedding")


@dataclass(frozen=True)
class ServedModel:
    name: str  # what requests name it (the repository name or an alias)
    repository_name: str  # the repository model that serves it
    kind: str
    tokenizer: Tokenizer
    created: int  # Unix time of openai.json (GET /v1/models' `created`)
    context: int = 0
    eos_token_id: int = -1
    max_input_tokens: int = 0

    async def tokenize(self, texts: list[str], special: bool) -> list[list[int]]:
        """The token ids of each text (with [CLS]/[SEP] if `special`). In a thread: encode_batch
        releases the GIL, and a long text takes milliseconds the event loop must not stall for."""
        encodings = await asyncio.to_thread(self.tokenizer.encode_batch, texts, add_special_tokens=special)
        return [list(e.ids) for e in encodings]

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def _load(model_dir: Path) -> list[ServedModel]:
    path = model_dir / OPENAI_FILE
    try:
        spec = json.loads(path.read_text())
        kind = spec["kind"]
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        tokenizer = Tokenizer.from_file(str(model_dir / str(spec["tokenizer"])))
        aliases = spec.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ValueError("aliases must be a list of names")
    except Exception as exc:  # tokenizers raises its own exception types for a bad file
        raise ConfigError(f"{path}: cannot serve it on /v1: {exc}") from None
    # Counting needs every token; the embedder truncates explicitly (engine/openai_api.py).
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return [ServedModel(
        name=name, repository_name=model_dir.name, kind=kind, tokenizer=tokenizer, created=int(path.stat().st_mtime),
        context=int(spec.get("context", 0)), eos_token_id=int(spec.get("eos_token_id", -1)),
        max_input_tokens=int(spec.get("max_input_tokens", 0)),
    ) for name in [model_dir.name, *aliases]]


def load_served(directory: Path, names: Iterable[str]) -> dict[str, ServedModel]:
    """The repository's models (of `names`) that have an openai.json, by every name they answer to."""
    served: dict[str, ServedModel] = {}
    for n in names:
        if (directory / n / OPENAI_FILE).is_file():
            for model in _load(directory / n):
                if model.name in served:
                    raise ConfigError(f"{directory / n / OPENAI_FILE}: the name {model.name!r} is served twice")
                served[model.name] = model
    return served


def chat_prompt(messages: list[tuple[str, str]]) -> str:
    """The chat template: one `role: text` line per message, then `assistant:` for the answer."""
    return "".join(f"{role}: {text}\n" for role, text in messages) + "assistant:"


def rng_for(seed: int | None, choice: int) -> np.random.Generator:
    """Choice `choice`'s sampler: a fixed stream for a given seed (same seed, same answer), fresh
    entropy without one, as OpenAI's API does."""
    if seed is None:
        return np.random.Generator(np.random.PCG64())
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed % 2**64, choice])))


def pick(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature) cut to the top_p
    nucleus. float64 and numpy's PCG64 only: the same draw on every machine."""
    if temperature == 0:
        return int(np.argmax(logits))
    # Shift before dividing: a tiny temperature then underflows to greedy instead of inf - inf = NaN.
    z = logits.astype(np.float64)
    with np.errstate(over="ignore", under="ignore"):  # -inf and 0 are the intended results
        p = np.exp((z - z.max()) / temperature)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
        nucleus = np.zeros_like(p)
        nucleus[keep] = p[keep]
        p = nucleus / nucleus.sum()
    cumulative = np.cumsum(p)
    # side="right": a token of probability 0 (a masked one) can never be drawn.
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(p) - 1)
