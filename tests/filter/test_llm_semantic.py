"""The semantic layer and tokens saved through a real Envoy, the real engine (llama3-tiny behind
the LLM demo names, all-minilm-l6-v2 embeddings) and the real semantic index service (issue 38,
docs/llm.md "The semantic layer"). Tokens saved: every hit adds its entry's stored `usage` to
`meshcache.policy.<prefix>.tokens_saved_*`. Semantic: a paraphrase in the same exact scope is answered from the stored
answer (`Cache-Status: meshcache; hit; detail=semantic`, `x-meshcache-similarity`); a differing
caller (principal-scoped policy), model, system prompt, history, stream flag or sampling
parameter never matches; shadow mode goes
upstream and reports whether the answers matched; a service that is down costs nothing but
`meshcache.semantic.errors`. Every test runs on both hosts (the Wasm filter's HTTP calls, the
native module's stream callout and config-level posts); the paraphrase test also on the module's
Envoy 1.39 build."""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshcache.contract.filter_config import LLM_DEMO_POLICIES
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import SEMANTIC_CLUSTER
from meshcache.ctl.launchers import Engine, Semantic
from meshcache.ctl.mesh.demo_llm import CHAT_PATH
from meshcache.ctl.pki import CertificateAuthority, Identity, spiffe_id
from tests.engine.helpers import running_engine
from tests.filter.stack import Stack, config, filter_stack
from tests.helpers.wait import eventually

STORED = "meshcache; fwd=miss; stored"
SEMANTIC_HIT = "meshcache; hit; detail=semantic"
QUESTION = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"
# Below the paraphrase's similarity with all-minilm-l6-v2 (about 0.97), above unrelated prompts'.
THRESHOLD = 0.9


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    repo = launchers.init_demo_models(tmp_path_factory.mktemp("models"), llm=True)
    with running_engine(repo, tmp_path_factory.mktemp("engine-logs")) as e:
        yield e


@pytest.fixture(scope="module")
def service(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Semantic]:
    s = launchers.start_semantic(engine.http_url, tmp_path_factory.mktemp("semantic"))
    with procs.supervised([s.proc]):
        yield s


@pytest.fixture
def index(service: Semantic) -> Iterator[httpx.Client]:
    """The service, emptied for this test (its shadow counts are per policy: read them as deltas)."""
    with httpx.Client(base_url=service.url, timeout=30) as c:
        c.post("/v1/semantic/purge", json={"all": True}).raise_for_status()
        yield c


def _config(semantic: dict[str, Any] | None, semantic_port: int | None, **fields: Any) -> dict[str, Any]:
    policies = ({"model_prefix": prefix, **spec, **({"semantic": semantic} if semantic is not None else {}), **fields}
                for prefix, spec in LLM_DEMO_POLICIES.items())
    service = {} if semantic_port is None else {"semantic_service": {
        "cluster": SEMANTIC_CLUSTER, "authority": f"127.0.0.1:{semantic_port}",
        # Generous: the first embeddings of a cold engine on a busy machine; failing open is its own test.
        "timeout_ms": 5000}}
    return config(*policies, **service)


def _body(question: str = QUESTION, **fields: Any) -> dict[str, Any]:
    return {"model": "llama3-70b-demo", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "system", "content": "You are a support agent."},
                         {"role": "user", "content": question}], **fields}


def _post(http: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    r = http.post(CHAT_PATH, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    return r


def _usage(r: httpx.Response) -> dict[str, int]:
    if r.headers["content-type"].startswith("text/event-stream"):
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return next(c["usage"] for c in reversed(chunks) if c.get("usage"))  # type: ignore[no-any-return]
    return r.json()["usage"]  # type: ignore[no-any-return]


def _indexed(index: httpx.Client, entries: int) -> None:
    """The filter's store calls are fire and forget: wait until the index holds `entries`."""
    def holds() -> bool:
        assert index.get("/v1/semantic/stats").json()["entries"] == entries
        return True

    eventually(holds, 10)


def test_hits_count_the_tokens_their_entries_saved(tmp_path: Path, engine: Engine, host: str) -> None:
    with filter_stack(tmp_path, _config(None, None), upstream=(engine.http_port, engine.grpc_port), host=host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        chat = _post(http, _body())
        stream = _post(http, _body(stream=True, stream_options={"include_usage": True}))
        no_usage = _post(http, _body(stream=True))  # a stream without usage saves nothing countable
        assert [r.headers["cache-status"] for r in (chat, stream, no_usage)] == [STORED, "meshcache; fwd=miss",
                                                                                 "meshcache; fwd=miss"]
        u, su = _usage(chat), _usage(stream)
        assert u["prompt_tokens"] > 0 and u["completion_tokens"] > 0
        for body in (_body(), _body(), _body(stream=True, stream_options={"include_usage": True}), _body(stream=True)):
            assert _post(http, body).headers["cache-status"].startswith("meshcache; hit")
        s.stats_reaching({
            "meshcache.hits": 4,
            "meshcache.policy.llama3-.tokens_saved_prompt": 2 * u["prompt_tokens"] + su["prompt_tokens"],
            "meshcache.policy.llama3-.tokens_saved_completion": 2 * u["completion_tokens"] + su["completion_tokens"],
        })


def _semantic_stack(tmp_path: Path, engine: Engine, semantic: dict[str, Any], port: int,
                    host: str) -> contextlib.AbstractContextManager[Stack]:
    return filter_stack(tmp_path, _config(semantic, port), upstream=(engine.http_port, engine.grpc_port),
                        host=host, semantic_port=port)


@pytest.mark.envoy_1_39
def test_a_paraphrase_is_served_from_the_stored_answer(tmp_path: Path, engine: Engine, service: Semantic,
                                                      index: httpx.Client, host: str) -> None:
    with _semantic_stack(tmp_path, engine, {"threshold": THRESHOLD}, service.port, host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        first = _post(http, _body())
        assert first.headers["cache-status"] == STORED
        _indexed(index, 1)
        for _ in range(2):
            again = _post(http, _body(PARAPHRASE))
            assert again.headers["cache-status"] == SEMANTIC_HIT
            similarity = again.headers["x-meshcache-similarity"]
            assert len(similarity.split(".")[1]) == 4 and THRESHOLD <= float(similarity) < 1, similarity
            assert again.content == first.content, "the stored answer, byte for byte"
        # The paraphrase's exact entry was never stored: a semantic hit stores nothing.
        u = _usage(first)
        s.stats_reaching({"meshcache.semantic.lookups": 3, "meshcache.semantic.hits": 2, "meshcache.hits": 2,
                          "meshcache.stores": 1, "meshcache.semantic.errors": 0,
                          "meshcache.policy.llama3-.tokens_saved_prompt": 2 * u["prompt_tokens"],
                          "meshcache.policy.llama3-.tokens_saved_completion": 2 * u["completion_tokens"]})
        # An exact repeat is an exact hit (no lookup).
        assert _post(http, _body()).headers["cache-status"].startswith("meshcache; hit; ttl=")


def test_a_paraphrase_in_another_scope_never_matches(tmp_path: Path, engine: Engine, service: Semantic,
                                                    index: httpx.Client, host: str) -> None:
    with _semantic_stack(tmp_path, engine, {"threshold": THRESHOLD}, service.port, host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        assert _post(http, _body()).headers["cache-status"] == STORED
        _indexed(index, 1)
        others = {
            "model": _body(PARAPHRASE, model="llama3-tiny"),
            "system prompt": _body(PARAPHRASE, messages=[{"role": "system", "content": "You are a pirate."},
                                                         {"role": "user", "content": PARAPHRASE}]),
            "history": _body(PARAPHRASE, messages=[{"role": "system", "content": "You are a support agent."},
                                                   {"role": "user", "content": "hello"},
                                                   {"role": "assistant", "content": "hi"},
                                                   {"role": "user", "content": PARAPHRASE}]),
            "max_tokens": _body(PARAPHRASE, max_tokens=9),
            "sampling": _body(PARAPHRASE, temperature=0.5, seed=3),
        }
        for what, body in others.items():
            assert _post(http, body).headers["cache-status"] == STORED, what
        streamed = _post(http, _body(PARAPHRASE, stream=True))
        assert streamed.headers["cache-status"] == "meshcache; fwd=miss", "stream flag"
        assert streamed.text.rstrip().endswith("data: [DONE]")
        n = len(others) + 1
        s.stats_reaching({"meshcache.semantic.lookups": 1 + n, "meshcache.semantic.hits": 0,
                          "meshcache.semantic.would_hit": 0, "meshcache.stores": 1 + n})
        # Each was indexed in its own scope: the same paraphrase again is an exact hit in each.
        _indexed(index, 1 + n)
        assert index.get("/v1/semantic/stats").json()["scopes"] == 1 + n


def test_a_principal_scoped_policy_never_serves_one_callers_answer_to_another(
        tmp_path: Path, engine: Engine, service: Semantic, index: httpx.Client, host: str) -> None:
    ca = CertificateAuthority.create()
    server = ca.issue(spiffe_id("ml", "engine"), tmp_path / "pki", "server")
    alice, bob = (ca.issue(spiffe_id(f"team-{who}", "app"), tmp_path / "pki", who) for who in ("a", "b"))
    cfg = _config({"threshold": THRESHOLD}, service.port, scope="principal")
    with filter_stack(tmp_path, cfg, upstream=(engine.http_port, engine.grpc_port), host=host,
                      semantic_port=service.port, tls=server) as s, _tls_client(alice) as a, _tls_client(bob) as b:
        url = f"https://localhost:{s.listen_port}{CHAT_PATH}"

        def post(client: httpx.Client, question: str) -> str:
            r = client.post(url, json=_body(question))
            assert r.status_code == 200, r.text
            return r.headers["cache-status"]

        assert post(a, QUESTION) == STORED
        _indexed(index, 1)
        assert post(a, PARAPHRASE) == SEMANTIC_HIT, "the same caller: its own answer"
        assert post(b, PARAPHRASE) == STORED, "another caller: never alice's answer"
        s.stats_reaching({"meshcache.semantic.lookups": 3, "meshcache.semantic.hits": 1, "meshcache.stores": 2})


def _tls_client(identity: Identity) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(identity.ca))
    ctx.load_cert_chain(str(identity.cert), str(identity.key))
    return httpx.Client(verify=ctx, timeout=30)


def test_shadow_mode_goes_upstream_and_reports_the_comparison(tmp_path: Path, engine: Engine, service: Semantic,
                                                             index: httpx.Client, host: str) -> None:
    before = index.get("/v1/semantic/stats").json()["shadow"].get("llama3-", {"would_hit": 0})["would_hit"]
    with _semantic_stack(tmp_path, engine, {"threshold": THRESHOLD, "shadow": True}, service.port, host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        first = _post(http, _body())
        _indexed(index, 1)
        paraphrase = _post(http, _body(PARAPHRASE))
        assert paraphrase.headers["cache-status"] == STORED, "shadow mode never serves"
        assert "x-meshcache-similarity" not in paraphrase.headers
        s.stats_reaching({"meshcache.semantic.would_hit": 1, "meshcache.semantic.hits": 0, "meshcache.stores": 2})

        def reported() -> dict[str, Any]:
            counts = index.get("/v1/semantic/stats").json()["shadow"]["llama3-"]
            assert counts["would_hit"] == before + 1
            return counts  # type: ignore[no-any-return]

        counts = eventually(reported, 10)
        # The engine's greedy answers to the two prompts: the report says whether they are equal.
        same = json.loads(first.content)["choices"][0]["message"]["content"] == \
            json.loads(paraphrase.content)["choices"][0]["message"]["content"]
        assert counts["matched" if same else "mismatched"] >= 1


def test_a_service_that_is_down_costs_only_an_error_count(tmp_path: Path, engine: Engine, host: str) -> None:
    nobody = procs.free_port()
    with _semantic_stack(tmp_path, engine, {"threshold": THRESHOLD}, nobody, host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        assert _post(http, _body()).headers["cache-status"] == STORED
        assert _post(http, _body(PARAPHRASE)).headers["cache-status"] == STORED
        assert _post(http, _body()).headers["cache-status"].startswith("meshcache; hit; ttl=")
        stats = s.stats_reaching({"meshcache.semantic.lookups": 2, "meshcache.stores": 2, "meshcache.hits": 1})
        # Two failed lookups, and the two fire-and-forget stores whose answers are not read.
        assert stats["meshcache.semantic.errors"] >= 2
