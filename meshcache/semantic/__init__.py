"""The semantic index service (issue 38): on an exact cache miss the filter asks it for a stored
answer whose prompt differs only in the last user message, by embedding similarity (docs/llm.md)."""

# The shipped embedder (the engine's all-MiniLM-L6-v2) and the default similarity threshold: the
# lowest with no wrong match on bench/data/semantic_pairs.jsonl (docs/benchmarks.md, section
# semantic-precision). It is specific to that data: measure your own traffic in shadow mode.
EMBEDDER_MODEL = "all-minilm-l6-v2"
DIMS = 384
DEFAULT_THRESHOLD = 0.999
