"""The OpenAI-compatible endpoints of a real engine process over real HTTP, on the LLM demo models
(`meshcache-engine init-models --llm`): chat and text completions (whole and as server-sent
events), embeddings checked against a numpy forward pass of all-MiniLM-L6-v2, /v1/models, and
OpenAI's error shape for bad input."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from meshcache.engine.llm_models import CONTEXT, EMBEDDER, GENERATOR, GENERATOR_ALIASES, read_bundle, weights_zip
from tests.engine import minilm_reference
from tests.engine.helpers import Engine, metric_value, running_engine
from tests.helpers.wait import eventually

CHAT = "/v1/chat/completions"
HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def llm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from meshcache.ctl import launchers

    return launchers.init_demo_models(tmp_path_factory.mktemp("llm-models"), llm=True)


@pytest.fixture(scope="module")
def llm_engine(llm_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with running_engine(llm_repo, tmp_path_factory.mktemp("llm-engine-logs")) as e:
        yield e


@pytest.fixture(scope="module")
def client(llm_engine: Engine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=llm_engine.http_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(llm_repo: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(llm_repo / GENERATOR / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def count(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def template(messages: list[dict[str, str]]) -> str:
    """The chat template the engine documents (docs/engine.md)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def events(raw: bytes) -> list[bytes]:
    """The SSE events of a stream, checking the framing: every event is one `data: ` line ended by a
    blank line, and nothing follows the last one."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    parts = raw[:-2].split(b"\n\n")
    for part in parts:
        assert part.startswith(b"data: ") and b"\n" not in part, part
    return [p[len(b"data: "):] for p in parts]


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[dict[str, Any]]]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        raw = r.read()
    assert r.status_code == 200, raw
    assert r.headers["content-type"] == "text/event-stream"
    # Storable by the mesh's cache: no Cache-Control no-cache (the filter would not store it).
    assert "cache-control" not in r.headers and r.headers["transfer-encoding"] == "chunked"
    data = events(raw)
    assert data[-1] == b"[DONE]"
    return r, [json.loads(d) for d in data[:-1]]


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post(CHAT, json={"model": GENERATOR, "messages": HELLO, **body})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_models_lists_the_openai_models(client: httpx.Client) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    listed = r.json()
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == sorted([EMBEDDER, GENERATOR, *GENERATOR_ALIASES])
    assert GENERATOR_ALIASES == ("llama3-70b-demo", "gemma2-27b-demo")  # the TTL table's model prefixes
    assert all(m["object"] == "model" and isinstance(m["created"], int) for m in listed["data"])
    assert client.get(f"/v1/models/{GENERATOR}").json()["id"] == GENERATOR
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def greedy_reference(llm_repo: Path, prompt_ids: list[int], steps: int) -> list[int]:
    """The generator run alone on onnxruntime, greedily: what temperature 0 must answer."""
    session = ort.InferenceSession(str(llm_repo / GENERATOR / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    context, out = list(prompt_ids), []
    for _ in range(steps):
        window = context[-CONTEXT:]
        feed = np.array([[0] * (CONTEXT - len(window)) + window], dtype=np.int64)
        token = int(np.argmax(session.run(["logits"], {"context": feed})[0][0]))
        if token == 102:  # [SEP]: the generator's end of text
            break
        out.append(token)
        context.append(token)
    return out


def test_chat_greedy_is_the_model_run_alone_and_usage_is_the_tokenizers_count(
        client: httpx.Client, llm_repo: Path, tokenizer: Tokenizer) -> None:
    first = chat(client, temperature=0, max_tokens=12)
    again = chat(client, temperature=0, max_tokens=12)
    assert first["object"] == "chat.completion" and first["model"] == GENERATOR
    content = first["choices"][0]["message"]["content"]
    assert first["choices"] == again["choices"]
    prompt_ids = tokenizer.encode(template(HELLO), add_special_tokens=False).ids
    expected = greedy_reference(llm_repo, prompt_ids, 12)
    assert content == tokenizer.decode(expected)
    usage = first["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids) == count(tokenizer, template(HELLO))
    assert usage["completion_tokens"] == count(tokenizer, content) == len(expected)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert first["choices"][0]["finish_reason"] == ("length" if len(expected) == 12 else "stop")


def test_seeded_sampling_repeats_and_another_seed_differs(client: httpx.Client, tokenizer: Tokenizer) -> None:
    a = chat(client, temperature=1.0, seed=7, n=3, max_tokens=10)
    b = chat(client, temperature=1.0, seed=7, n=3, max_tokens=10)
    c = chat(client, temperature=1.0, seed=8, n=3, max_tokens=10)
    texts = [ch["message"]["content"] for ch in a["choices"]]
    assert texts == [ch["message"]["content"] for ch in b["choices"]]
    assert texts != [ch["message"]["content"] for ch in c["choices"]]
    assert len(set(texts)) == 3, "the n choices of one request are drawn apart"
    assert [ch["index"] for ch in a["choices"]] == [0, 1, 2]
    assert a["usage"]["completion_tokens"] == sum(count(tokenizer, t) for t in texts)
    # Greedy differs from sampling, and top_p close to 0 is greedy.
    greedy = chat(client, temperature=0, max_tokens=10)["choices"][0]["message"]["content"]
    assert greedy not in texts
    nucleus = chat(client, temperature=1.0, top_p=1e-6, seed=1, max_tokens=10)
    assert nucleus["choices"][0]["message"]["content"] == greedy
    # So is the smallest positive temperature (no overflow to NaN on the way).
    assert chat(client, temperature=5e-324, seed=1, max_tokens=10)["choices"][0]["message"]["content"] == greedy


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_is_framed_sse_with_the_same_answer(client: httpx.Client, include_usage: bool) -> None:
    body = {"model": GENERATOR, "messages": HELLO, "temperature": 0.9, "seed": 11, "n": 2, "max_tokens": 9}
    whole = client.post(CHAT, json=body).json()
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    _, chunks = stream(client, CHAT, {**body, **extra})
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == GENERATOR for c in chunks)
    if include_usage:
        *chunks, last = chunks
        assert last["choices"] == [] and last["usage"] == whole["usage"]
        assert all(c["usage"] is None for c in chunks)
    else:
        assert all("usage" not in c for c in chunks)
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content", "") for m in mine) == choice["message"]["content"]
        assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == choice["finish_reason"] and mine[-1]["delta"] == {}


@pytest.mark.parametrize("words", [1, 2])
def test_stop_strings_cut_the_answer_streamed_or_not(client: httpx.Client, words: int) -> None:
    full = chat(client, temperature=0, max_tokens=8)["choices"][0]["message"]["content"]
    # One word, or two (a stop string that spans two streamed deltas: the stream must hold the
    # first back until it knows, or it would send text the whole answer does not have).
    stop = " ".join(full.split(" ")[2:2 + words])
    cut = chat(client, temperature=0, max_tokens=8, stop=["zzzz", stop])["choices"][0]
    assert cut["message"]["content"] == full[:full.index(stop)]
    assert cut["finish_reason"] == "stop"
    _, chunks = stream(client, CHAT, {"model": GENERATOR, "messages": HELLO, "temperature": 0, "max_tokens": 8,
                                      "stop": ["zzzz", stop]})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == cut["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_text_completions_whole_echo_and_stream(client: httpx.Client, tokenizer: Tokenizer) -> None:
    body = {"model": GENERATOR, "prompt": ["Once upon a time", "The weather today"], "temperature": 0,
            "max_tokens": 6}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["object"] == "text_completion" and [c["index"] for c in whole["choices"]] == [0, 1]
    texts = [c["text"] for c in whole["choices"]]
    assert all(t.startswith(" ") for t in texts), "a completion continues its prompt after a space"
    assert whole["usage"]["prompt_tokens"] == sum(count(tokenizer, p) for p in body["prompt"])
    assert whole["usage"]["completion_tokens"] == sum(count(tokenizer, t) for t in texts)
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()
    assert [c["text"] for c in echoed["choices"]] == [p + t for p, t in zip(body["prompt"], texts, strict=True)]
    _, chunks = stream(client, "/v1/completions", body)
    for i, text in enumerate(texts):
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) == text


def test_embeddings_match_a_numpy_forward_pass(client: httpx.Client) -> None:
    weights, tokenizer_json = read_bundle(weights_zip())
    tok = Tokenizer.from_str(tokenizer_json.decode())
    tok.no_truncation()
    tok.no_padding()
    texts = ["How do I reset my password?", "What is the way to change my password?",
             "The recipe needs two cups of flour.", "a"]
    r = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    got = np.array([d["embedding"] for d in body["data"]])
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and got.shape == (4, 384)
    ids = [tok.encode(t).ids for t in texts]  # with [CLS] and [SEP], as the model reads them
    reference = np.array([minilm_reference.embed(weights, i) for i in ids])
    np.testing.assert_allclose(got, reference, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = got @ got.T
    assert cos[0, 1] > 0.7 and cos[0, 2] < 0.3, cos
    assert body["usage"] == {"prompt_tokens": sum(len(i) for i in ids), "total_tokens": sum(len(i) for i in ids)}
    # base64 is the same float32 vector; a lone string is one item; padding in a batch changes nothing.
    b64 = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": texts[2],
                                              "encoding_format": "base64"}).json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(b64), dtype="<f4"), got[2].astype(np.float32))
    many = [f"sentence number {i} about {'cats' if i % 2 else 'the stock market'}" for i in range(20)]
    batched = np.array([d["embedding"] for d in client.post(
        "/v1/embeddings", json={"model": EMBEDDER, "input": many}).json()["data"]])
    alone = np.array([client.post("/v1/embeddings", json={"model": EMBEDDER, "input": s}).json()["data"][0]["embedding"]
                      for s in many[:3] + many[17:]])
    np.testing.assert_allclose(batched[[0, 1, 2, 17, 18, 19]], alone, atol=1e-5)


def test_long_embedding_input_is_cut_to_the_models_length(client: httpx.Client) -> None:
    long = " ".join(["word"] * 400)
    body = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": long}).json()
    assert body["usage"]["prompt_tokens"] == 256


GOOD_CHAT = {"model": GENERATOR, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [
    (CHAT, {**GOOD_CHAT, "model": "gpt-4"}, 404, "model", "model_not_found"),
    (CHAT, b"{not json", 400, None, "invalid_json"),
    (CHAT, b"[1, 2]", 400, None, "invalid_json"),
    (CHAT, {"messages": GOOD_CHAT["messages"]}, 400, "model", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "messages": []}, 400, "messages", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    (CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "temperature": 3}, 400, "temperature", "invalid_value"),
    (CHAT, {**GOOD_CHAT, "n": 0}, 400, "n", "invalid_value"),
    (CHAT, {**GOOD_CHAT, "n": 9}, 400, "n", "invalid_value"),
    (CHAT, {**GOOD_CHAT, "n": True}, 400, "n", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (CHAT, {**GOOD_CHAT, "max_tokens": 257}, 400, "max_tokens", "invalid_value"),
    (CHAT, {**GOOD_CHAT, "max_completion_tokens": 1.5}, 400, "max_completion_tokens", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "seed": "1"}, 400, "seed", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "stream": "yes"}, 400, "stream", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    (CHAT, {**GOOD_CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_type"),
    (CHAT, {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "unsupported_parameter"),
    (CHAT, {**GOOD_CHAT, "model": EMBEDDER}, 400, "model", "model_not_supported"),
    ("/v1/completions", {"model": GENERATOR, "prompt": [1, 2, 3]}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"model": GENERATOR, "prompt": ["x"] * 9, "n": 2}, 400, "n", "invalid_value"),
    ("/v1/embeddings", {"model": EMBEDDER, "input": ""}, 400, "input", "invalid_value"),
    ("/v1/embeddings", {"model": EMBEDDER, "input": ["a", 3]}, 400, "input", "invalid_type"),
    ("/v1/embeddings", {"model": EMBEDDER, "input": ["a"] * 65}, 400, "input", "invalid_value"),
    ("/v1/embeddings", {"model": EMBEDDER, "input": "a", "dimensions": 128}, 400, "dimensions", "invalid_value"),
    ("/v1/embeddings", {"model": EMBEDDER, "input": "a", "encoding_format": "int8"}, 400, "encoding_format",
     "invalid_value"),
    ("/v1/embeddings", {"model": GENERATOR, "input": "a"}, 400, "model", "model_not_supported"),
    (CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": "x" * (2**20)}]}, 413, None, "request_too_large"),
    (CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": "x " * 20000}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"model": GENERATOR, "prompt": ["ok", "y" * 40000]}, 400, "prompt", "context_length_exceeded"),
    ("/v1/embeddings", {"model": EMBEDDER, "input": ["ok", "z " * 20000]}, 400, "input", "context_length_exceeded"),
])
def test_bad_requests_get_openai_errors(client: httpx.Client, path: str, body: dict[str, Any] | bytes, status: int,
                                        param: str | None, code: str) -> None:
    r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["message"] and error["error"]["type"] == "invalid_request_error"
    assert (error["error"]["param"], error["error"]["code"]) == (param, code)
    assert client.get("/v1/models").status_code == 200, "the engine still serves"


def test_wrong_methods_are_405_in_openai_shape(client: httpx.Client) -> None:
    assert client.get(CHAT).status_code == 405
    r = client.post("/v1/models", json={})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_an_unloaded_model_is_not_found_and_listed_no_more(llm_repo: Path, tmp_path: Path) -> None:
    with running_engine(llm_repo, tmp_path) as engine, httpx.Client(base_url=engine.http_url, timeout=60) as c:
        assert c.post(f"/v2/repository/models/{GENERATOR}/unload").status_code == 200
        eventually(lambda: [m["id"] for m in c.get("/v1/models").json()["data"]] == [EMBEDDER], timeout=30)
        r = c.post(CHAT, json=GOOD_CHAT)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # The embedder keeps serving, also on KServe v2 (the same model, the same batcher).
        assert c.post("/v1/embeddings", json={"model": EMBEDDER, "input": "still here"}).status_code == 200


def _digests(repo: Path) -> dict[str, str]:
    return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(repo.rglob("*"))
            if p.is_file()}


def test_init_models_llm_is_deterministic_and_stamped_apart(llm_repo: Path, tmp_path: Path) -> None:
    from meshcache.ctl import launchers

    again = launchers.init_demo_models(tmp_path / "again", llm=True)
    digests = _digests(again)
    assert digests == _digests(llm_repo)
    for name in (GENERATOR, EMBEDDER):
        assert {f"{name}/config.pbtxt", f"{name}/1/model.onnx", f"{name}/openai.json",
                f"{name}/tokenizer.json"} <= set(digests)
    assert " llm=" in (again / "demo-models.version").read_text()
    # A repository written without --llm is stale for --llm (and the other way round).
    launchers.init_demo_models(again, if_stale=True)
    assert not (again / GENERATOR).exists()
    launchers.init_demo_models(again, if_stale=True, llm=True)
    assert _digests(again) == digests


def test_concurrent_requests_batch_without_changing_answers(client: httpx.Client) -> None:
    # Concurrent requests may share the generator's batches (dynamic batching); each answer is the
    # one the request gets alone.
    bodies = [{"temperature": 0.7, "seed": s, "max_tokens": 12, "n": 1 + s % 2} for s in range(8)]
    alone = [chat(client, **b)["choices"] for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: chat(client, **b)["choices"], bodies))
    assert together == alone


_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
_FIELDS = ["model", "messages", "prompt", "input", "temperature", "top_p", "seed", "n", "max_tokens",
           "max_completion_tokens", "stop", "stream", "stream_options", "echo", "presence_penalty",
           "frequency_penalty", "encoding_format", "dimensions", "tools", "response_format", "logprobs"]
_VALID = {"model": st.sampled_from([GENERATOR, EMBEDDER]),
          "messages": st.just([{"role": "user", "content": "hi"}]), "prompt": st.just("hi"),
          "input": st.just("hi"), "max_tokens": st.integers(1, 4), "stream": st.booleans()}


@given(path=st.sampled_from([CHAT, "/v1/completions", "/v1/embeddings"]),
       body=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6),
       valid=st.fixed_dictionaries({}, optional=_VALID))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
def test_any_json_body_gets_an_answer_or_an_openai_error(client: httpx.Client, path: str, body: dict[str, Any],
                                                         valid: dict[str, Any]) -> None:
    # Fields of any JSON type mixed with valid ones: never a server error, and every refusal in
    # OpenAI's shape (a 200 stream is checked for its framing).
    r = client.post(path, json={**valid, **body})
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif r.headers["content-type"] == "text/event-stream":
        assert events(r.content)[-1] == b"[DONE]"
    else:
        assert "usage" in r.json()


def test_tokens_metric_counts_the_answers_usage(client: httpx.Client, llm_engine: Engine) -> None:
    def tokens(model: str, kind: str) -> float:
        return metric_value(httpx.get(llm_engine.metrics_url, timeout=10).text, "meshcache_engine_tokens_total",
                            model=model, kind=kind)

    before = {(m, k): tokens(m, k) for m in (GENERATOR, EMBEDDER) for k in ("prompt", "completion")}
    whole = chat(client, temperature=0, max_tokens=5)["usage"]
    _, chunks = stream(client, CHAT, {"model": GENERATOR, "messages": HELLO, "temperature": 0, "max_tokens": 7,
                                      "stream_options": {"include_usage": True}})
    streamed = chunks[-1]["usage"]
    embedded = client.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["one", "two words"]}).json()["usage"]
    prompt = tokens(GENERATOR, "prompt") - before[GENERATOR, "prompt"]
    assert prompt == whole["prompt_tokens"] + streamed["prompt_tokens"] > 0
    completion = tokens(GENERATOR, "completion") - before[GENERATOR, "completion"]
    assert completion == whole["completion_tokens"] + streamed["completion_tokens"] > 0
    assert tokens(EMBEDDER, "prompt") - before[EMBEDDER, "prompt"] == embedded["prompt_tokens"]


def test_an_alias_is_the_same_model_under_its_own_name(client: httpx.Client) -> None:
    plain = chat(client, temperature=0, max_tokens=6)
    for alias in GENERATOR_ALIASES:
        aliased = chat(client, model=alias, temperature=0, max_tokens=6)
        assert aliased["model"] == alias
        assert aliased["choices"] == plain["choices"] and aliased["usage"] == plain["usage"]
        _, chunks = stream(client, CHAT, {"model": alias, "messages": HELLO, "temperature": 0, "max_tokens": 2})
        assert {c["model"] for c in chunks} == {alias}
