"""The semantic index service as a real process, embedding with the real engine's
all-minilm-l6-v2 over /v1/embeddings: a paraphrase in the same exact scope matches, nothing
matches across scopes (principal, model, system prompt, history, stream flag, parameters),
entries expire with their TTL, purge drops them, memory is bounded, bad input is a 4xx with what
is wrong and writes nothing, and a failing embedder is a 503 (the caller goes upstream)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshcache.ctl import procs
from meshcache.ctl.launchers import Engine, Semantic, start_semantic
from meshcache.semantic import DEFAULT_THRESHOLD
from meshcache.semantic.scope import semantic_scope
from tests.helpers.wait import eventually

POLICY = "llama3-"
QUESTION = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"


@pytest.fixture(scope="module")
def service(llm_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Semantic]:
    s = start_semantic(llm_engine.http_url, tmp_path_factory.mktemp("semantic"))
    with procs.supervised([s.proc]):
        yield s


@pytest.fixture
def http(service: Semantic) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=30) as c:
        c.post("/v1/semantic/purge", json={"all": True}).raise_for_status()
        yield c


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "llama3-70b-demo", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "system", "content": "You are a support agent."},
                         {"role": "user", "content": QUESTION}], **fields}


def _store(http: httpx.Client, scope: str, text: str, key: str, ttl_s: int = 600, policy: str = POLICY) -> None:
    r = http.post("/v1/semantic/store", json={"policy": policy, "scope": scope, "text": text, "key": key,
                                              "ttl_s": ttl_s})
    assert r.status_code == 200, r.text


def _lookup(http: httpx.Client, scope: str, text: str, shadow: bool = False,
            threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    r = http.post("/v1/semantic/lookup", json={"scope": scope, "text": text, "threshold": threshold,
                                               "shadow": shadow})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_paraphrase_in_scope_hits_and_shadow_only_reports(http: httpx.Client) -> None:
    scope, text = semantic_scope(_chat(), POLICY)
    assert text == QUESTION
    _store(http, scope, text, "key-1")
    # The threshold is the policy's (the caller's); the shipped default only lets near-identical
    # text through (docs/benchmarks.md, semantic-precision), so this one is lower.
    got = _lookup(http, scope, PARAPHRASE, threshold=0.95)
    assert got["hit"] and got["key"] == "key-1" and 0.95 <= got["similarity"] < DEFAULT_THRESHOLD, got
    assert not _lookup(http, scope, PARAPHRASE)["hit"], "below the default threshold"
    shadow = _lookup(http, scope, PARAPHRASE, shadow=True, threshold=0.95)
    assert (shadow["hit"], shadow["would_hit"], shadow["key"]) == (False, True, "key-1")
    assert shadow["similarity"] == got["similarity"]
    # Unrelated text in the same scope: the best similarity is reported, nothing is served.
    other = _lookup(http, scope, "What is the capital of France?")
    assert not other["hit"] and not other["would_hit"] and other["key"] is None and other["similarity"] < 0.5
    r = http.post("/v1/semantic/shadow", json={"policy": POLICY, "similarity": 0.97, "matched": False})
    assert r.json()["mismatched"] == 1 and r.json()["min_mismatched_similarity"] == 0.97


def test_response_hash_takes_the_filters_forms(http: httpx.Client) -> None:
    """The filter's `x-response-hash` (`xxh3-128:` and 32 hex; bare sha256 hex from filters
    before it) is stored and returned as given; anything else is refused."""
    scope, text = semantic_scope(_chat(), POLICY)
    for n, h in enumerate(("xxh3-128:" + "0f" * 16, "ab" * 32)):
        r = http.post("/v1/semantic/store", json={"policy": POLICY, "scope": scope, "text": f"{text} {n}",
                                                  "key": f"h{n}", "ttl_s": 60, "response_hash": h})
        assert r.status_code == 200, r.text
        got = _lookup(http, scope, f"{text} {n}", threshold=0.999)
        assert (got["key"], got["response_hash"]) == (f"h{n}", h), got
    for bad in ("xxh3-128:" + "0f" * 15, "blake3:" + "0f" * 16, "XXH3-128:" + "0f" * 16, "xxh3-128:" + "0F" * 16):
        r = http.post("/v1/semantic/store", json={"policy": POLICY, "scope": scope, "text": text, "key": "k",
                                                  "ttl_s": 60, "response_hash": bad})
        assert r.status_code == 422, bad


def test_nothing_matches_across_scopes(http: httpx.Client) -> None:
    base_scope, text = semantic_scope(_chat(), POLICY)
    _store(http, base_scope, text, "base")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    variants = {
        "principal": semantic_scope(_chat(), POLICY, principal="spiffe://cluster.local/ns/a/sa/web"),
        "model": semantic_scope(_chat(model="gemma2-27b-demo"), POLICY),
        "system prompt": semantic_scope(_chat(messages=[{"role": "system", "content": "You are a pirate."},
                                                        {"role": "user", "content": QUESTION}]), POLICY),
        "history": semantic_scope(_chat(messages=[{"role": "system", "content": "You are a support agent."},
                                                  *history, {"role": "user", "content": QUESTION}]), POLICY),
        "stream flag": semantic_scope(_chat(stream=True), POLICY),
        "temperature": semantic_scope(_chat(temperature=0.5, seed=1), POLICY),
        "max_tokens": semantic_scope(_chat(max_tokens=17), POLICY),
        "tools": semantic_scope(_chat(tools=[{"type": "function", "function": {"name": "f"}}]), POLICY),
        "policy generation (purged)": semantic_scope(_chat(), POLICY, generation=1),
    }
    for what, (scope, same_text) in variants.items():
        assert same_text == text and scope != base_scope, what
        got = _lookup(http, scope, text)
        assert (got["hit"], got["would_hit"], got["similarity"]) == (False, False, None), what
    # The same text in the base scope is the entry itself (so the misses above are the scope's doing).
    assert _lookup(http, base_scope, text)["similarity"] == pytest.approx(1.0, abs=1e-5)
    # ignore_fields (user, metadata) stay out of the scope, as they stay out of the exact key.
    assert semantic_scope(_chat(user="u1"), POLICY, ignore_fields=("user",))[0] == base_scope


def test_entries_expire_with_their_ttl(http: httpx.Client) -> None:
    short, text = semantic_scope(_chat(), POLICY)
    long_lived, _ = semantic_scope(_chat(max_tokens=5), POLICY)
    _store(http, short, text, "short", ttl_s=1)
    _store(http, long_lived, text, "long", ttl_s=600)
    eventually(lambda: _lookup(http, short, text)["similarity"] is None, timeout=15)
    assert _lookup(http, long_lived, text)["key"] == "long"
    assert http.get("/v1/semantic/stats").json()["expired"] >= 1


def test_purge_by_policy_scope_and_all(http: httpx.Client) -> None:
    a, text = semantic_scope(_chat(), POLICY)
    b, _ = semantic_scope(_chat(max_tokens=3), POLICY)
    c, _ = semantic_scope(_chat(model="gemma2-27b-demo"), "gemma2-")
    _store(http, a, text, "a")
    _store(http, b, text, "b")
    _store(http, c, text, "c", policy="gemma2-")
    assert http.post("/v1/semantic/purge", json={"policy": POLICY}).json() == {"purged": 2}
    assert _lookup(http, a, text)["similarity"] is None and _lookup(http, b, text)["similarity"] is None
    assert _lookup(http, c, text)["key"] == "c"
    assert http.post("/v1/semantic/purge", json={"scope": c}).json() == {"purged": 1}
    assert http.get("/v1/semantic/stats").json()["entries"] == 0


def test_bounded_per_scope_and_in_total(llm_engine: Engine, tmp_path: Path) -> None:
    texts = ["How do I bake sourdough bread?", "What is the boiling point of water at sea level?",
             "Recommend a science fiction novel.", "How far is the Moon from Earth?"]
    service = start_semantic(llm_engine.http_url, tmp_path, max_entries=5, max_per_scope=3)
    with procs.supervised([service.proc]), httpx.Client(base_url=service.url, timeout=30) as http:
        a, _ = semantic_scope(_chat(), POLICY)
        b, _ = semantic_scope(_chat(max_tokens=2), POLICY)
        for n, t in enumerate(texts):
            _store(http, a, t, f"a{n}")
        stats = http.get("/v1/semantic/stats").json()
        assert (stats["entries"], stats["evicted"]) == (3, 1)
        assert _lookup(http, a, texts[0], threshold=0.99)["key"] is None, "the oldest went first"
        assert _lookup(http, a, texts[3], threshold=0.99)["key"] == "a3"
        for n, t in enumerate(texts[:3]):
            _store(http, b, t, f"b{n}")
        stats = http.get("/v1/semantic/stats").json()
        assert (stats["entries"], stats["evicted"]) == (5, 2)
        assert _lookup(http, a, texts[1], threshold=0.99)["key"] is None, "the oldest of all went"
        assert _lookup(http, a, texts[2], threshold=0.99)["key"] == "a2"


def test_bad_input_is_4xx_and_writes_nothing(http: httpx.Client) -> None:
    scope, text = semantic_scope(_chat(), POLICY)
    good = {"policy": POLICY, "scope": scope, "text": text, "key": "k", "ttl_s": 60}
    bad_stores = [
        {k: v for k, v in good.items() if k != "key"}, {**good, "scope": "not-a-hash"},
        {**good, "scope": scope.upper()}, {**good, "ttl_s": 0}, {**good, "ttl_s": "60"}, {**good, "text": ""},
        {**good, "text": "x" * 32769}, {**good, "extra": 1}, {**good, "response_hash": "zz"},
    ]
    for body in bad_stores:
        r = http.post("/v1/semantic/store", json=body)
        assert r.status_code == 422 and r.json()["detail"], body
    assert http.post("/v1/semantic/store", content=b"{not json", headers={"content-type": "application/json"}
                     ).status_code == 422
    assert http.post("/v1/semantic/store", content=b"x" * (200 * 1024)).status_code == 413
    for body in ({"scope": scope, "text": text, "threshold": 0}, {"scope": scope, "text": text, "threshold": 1.5},
                 {"scope": scope, "threshold": 0.9}):
        assert http.post("/v1/semantic/lookup", json=body).status_code == 422, body
    for body in ({}, {"policy": POLICY, "scope": scope}, {"all": False}):
        r = http.post("/v1/semantic/purge", json=body)
        assert r.status_code == 422 and "exactly one" in r.text, body
    assert http.get("/v1/semantic/stats").json()["entries"] == 0
    # One scope belongs to one policy: a store naming another is refused, the entry kept.
    _store(http, scope, text, "k")
    r = http.post("/v1/semantic/store", json={**good, "policy": "gemma2-"})
    assert r.status_code == 409 and "belongs to policy" in r.json()["detail"]
    assert _lookup(http, scope, text)["key"] == "k"


def test_embedder_down_is_503(tmp_path: Path) -> None:
    service = start_semantic(f"http://127.0.0.1:{procs.free_port()}", tmp_path)
    with procs.supervised([service.proc]), httpx.Client(base_url=service.url, timeout=30) as http:
        scope, text = semantic_scope(_chat(), POLICY)
        r = http.post("/v1/semantic/store", json={"policy": POLICY, "scope": scope, "text": text, "key": "k",
                                                   "ttl_s": 60})
        assert r.status_code == 503 and "embedder unreachable" in r.json()["detail"]
        assert http.get("/v1/semantic/stats").json()["embedder_errors"] == 1
