"""Precision and hit rate of the semantic layer per similarity threshold, on a labelled set of prompt
pairs (bench/data/semantic_pairs.jsonl: paraphrases that should match; negations, swapped
entities, changed numbers, different units, near topics that must not), with the shipped embedder
(all-minilm-l6-v2 on the engine's /v1/embeddings). Writes docs/benchmarks.md, section
`semantic-precision`, and prints the lowest threshold with no wrong match on the set (the shipped
default, meshcache.semantic.DEFAULT_THRESHOLD). That number is specific to this data.

    .venv/bin/python -m bench.semantic_precision            # starts its own engine
    .venv/bin/python -m bench.semantic_precision --engine http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from bench.report import write_section
from meshcache.ctl import launchers, procs
from meshcache.semantic import DEFAULT_THRESHOLD, EMBEDDER_MODEL

PAIRS = Path(__file__).parent / "data" / "semantic_pairs.jsonl"
# 0.80 .. 0.99, then 0.991 .. 0.999: near-duplicates of short prompts embed above 0.99.
THRESHOLDS = [round(0.80 + 0.01 * i, 2) for i in range(20)] + [round(0.991 + 0.001 * i, 3) for i in range(9)]


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    match: bool
    kind: str


def load_pairs(path: Path = PAIRS) -> list[Pair]:
    return [Pair(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def embed(http: httpx.Client, texts: list[str], batch: int = 16) -> np.ndarray:
    rows = []
    for i in range(0, len(texts), batch):
        r = http.post("/v1/embeddings", json={"model": EMBEDDER_MODEL, "input": texts[i:i + batch]})
        r.raise_for_status()
        rows += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    return np.asarray(rows, dtype=np.float32)


def similarities(http: httpx.Client, pairs: list[Pair]) -> np.ndarray:
    texts = sorted({t for p in pairs for t in (p.a, p.b)})
    vectors = dict(zip(texts, embed(http, texts), strict=True))
    return np.asarray([float(vectors[p.a] @ vectors[p.b]) for p in pairs])


@dataclass(frozen=True)
class Row:
    threshold: float
    matched: int  # pairs at or above the threshold
    right: int  # of those, labelled match
    wrong: int
    paraphrases: int

    @property
    def precision(self) -> float:
        return self.right / self.matched if self.matched else 1.0

    @property
    def hit_rate(self) -> float:
        return self.right / self.paraphrases


def table(pairs: list[Pair], sims: np.ndarray, thresholds: list[float] = THRESHOLDS) -> list[Row]:
    labels = np.asarray([p.match for p in pairs])
    return [Row(t, int((sims >= t).sum()), int(((sims >= t) & labels).sum()), int(((sims >= t) & ~labels).sum()),
                int(labels.sum())) for t in thresholds]


def lowest_clean(rows: list[Row]) -> float:
    """The lowest threshold with no wrong match at it or above."""
    clean = [r.threshold for i, r in enumerate(rows) if all(s.wrong == 0 for s in rows[i:])]
    if not clean:
        raise ValueError("every threshold has a wrong match")
    return clean[0]


@contextlib.contextmanager
def engine_url(given: str | None) -> Iterator[str]:
    if given:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="meshcache-semantic-bench-") as tmp:
        repo = launchers.init_demo_models(Path(tmp) / "models", llm=True)
        engine = launchers.start_engine(repo, Path(tmp) / "logs")
        with procs.supervised([engine.proc]):
            yield engine.http_url


def report(pairs: list[Pair], sims: np.ndarray, rows: list[Row]) -> str:
    kinds = Counter(p.kind for p in pairs)
    lines = [
        f"`python -m bench.semantic_precision`: {len(pairs)} labelled prompt pairs "
        f"(`bench/data/semantic_pairs.jsonl`: {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
        f"cosine similarity of the two prompts' embeddings from `{EMBEDDER_MODEL}` (the engine's "
        "`/v1/embeddings`). A pair is matched when its similarity is at or above the threshold; precision = "
        "matched pairs labelled paraphrase / matched pairs; hit rate = paraphrases matched / all paraphrases.",
        "",
        "| threshold | matched | wrong | precision | hit rate |", "|---|---|---|---|---|",
        *(f"| {r.threshold:g} | {r.matched} | {r.wrong} | {r.precision:.3f} | {r.hit_rate:.3f} |" for r in rows),
        "",
        "Highest similarity of a pair that must not match, per kind (the wrong matches a threshold below it lets in):",
        "",
        "| kind | pairs | highest similarity | that pair |", "|---|---|---|---|",
    ]
    for kind in sorted(k for k in kinds if not any(p.match for p in pairs if p.kind == k)):
        idx = [i for i, p in enumerate(pairs) if p.kind == kind]
        worst = max(idx, key=lambda i: sims[i])
        lines.append(f"| {kind} | {len(idx)} | {sims[worst]:.4f} | {pairs[worst].a!r} / {pairs[worst].b!r} |")
    para = [i for i, p in enumerate(pairs) if p.match]
    lowest = min(para, key=lambda i: sims[i])
    clean = lowest_clean(rows)
    at_clean = next(r for r in rows if r.threshold == clean)
    lines += ["", f"Paraphrases: similarity {min(sims[para]):.4f} to {max(sims[para]):.4f} (median "
                  f"{float(np.median(sims[para])):.4f}); the lowest: {pairs[lowest].a!r} / {pairs[lowest].b!r}.",
              "", f"**Lowest threshold with no wrong match on this set: {clean:g}** (the shipped default, "
                  f"`meshcache.semantic.DEFAULT_THRESHOLD` = {DEFAULT_THRESHOLD}), where the hit rate is "
                  f"{at_clean.hit_rate:.1%} ({at_clean.right} of {at_clean.paraphrases} paraphrases). It is "
                  "specific to this data: short prompts that differ in one word (a negation, a number, a unit) "
                  "or only in word order (mean pooling barely sees order) embed about as close as paraphrases "
                  "do, and other traffic has other near-misses. Run a policy in shadow mode first and read its "
                  "mismatched similarities before turning it on."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", help="a running engine's HTTP URL serving all-minilm-l6-v2 (default: start one)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    pairs = load_pairs()
    with engine_url(args.engine) as url, httpx.Client(base_url=url, timeout=60) as http:
        sims = similarities(http, pairs)
    rows = table(pairs, sims)
    body = report(pairs, sims, rows)
    print(body)
    if not args.no_write:
        write_section("semantic-precision", "Semantic layer: precision and hit rate per threshold", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
