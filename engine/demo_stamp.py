"""The version stamp written next to the demo models (engine/demo_models.py), apart from the
models' code so that `init-models --if-stale` and the server need not import `onnx` (most of a
second of start-up) to check it."""

from __future__ import annotations

import hashlib
from pathlib import Path

STAMP_FILE = "demo-models.version"
# The generators whose source the stamp names: its hash changes whenever the models they write may.
GENERATOR = Path(__file__).with_name("demo_models.py")
LLM_GENERATOR = Path(__file__).with_name("llm_models.py")


def stamp(serve_versions: dict[str, int], llm: bool = False) -> str:
    """What `write_demo_models(directory, serve_versions, llm)` writes to the stamp file."""
    version = hashlib.sha256(GENERATOR.read_bytes()).hexdigest()
    parts = [version, *(f"{m}={v}" for m, v in sorted(serve_versions.items()))]
    if llm:
        parts.append("llm=" + hashlib.sha256(LLM_GENERATOR.read_bytes()).hexdigest())
    return " ".join(parts)


def is_current(directory: Path, serve_versions: dict[str, int] | None = None, llm: bool = False) -> bool:
    """Whether `directory` holds what `write_demo_models(directory, serve_versions, llm)` writes (its stamp matches)."""
    path = directory / STAMP_FILE
    return path.is_file() and path.read_text().strip() == stamp(dict(serve_versions or {}), llm)
