"""The shipped default threshold against the labelled pairs (bench/data/semantic_pairs.jsonl) with
the real embedder (the engine's all-minilm-l6-v2): no pair that must not match reaches it, and it
is the lowest threshold of the benchmark's grid with that property (what docs/benchmarks.md
publishes)."""

from __future__ import annotations

import httpx

from bench.semantic_precision import load_pairs, lowest_clean, similarities, table
from meshcache.ctl.launchers import Engine
from meshcache.semantic import DEFAULT_THRESHOLD


def test_default_threshold_has_no_wrong_match_on_the_labelled_pairs(llm_engine: Engine) -> None:
    pairs = load_pairs()
    assert len(pairs) >= 100 and {p.kind for p in pairs if not p.match} >= {
        "negation", "swapped-entities", "changed-number", "different-unit"}
    with httpx.Client(base_url=llm_engine.http_url, timeout=60) as http:
        sims = similarities(http, pairs)
    wrong = [(p.a, p.b, round(float(s), 4)) for p, s in zip(pairs, sims, strict=True)
             if not p.match and s >= DEFAULT_THRESHOLD]
    assert not wrong, f"pairs that must not match reach the default threshold {DEFAULT_THRESHOLD}: {wrong}"
    assert lowest_clean(table(pairs, sims)) == DEFAULT_THRESHOLD
    # And it still matches something: the set has paraphrases at or above it.
    assert any(p.match and s >= DEFAULT_THRESHOLD for p, s in zip(pairs, sims, strict=True))
