"""`meshcache demo --llm`: OpenAI-compatible chat completions through the local mesh's cache.

Shows what the cache does with LLM traffic (docs/llm.md): a deterministic chat is keyed on
its whole body (model, messages, sampling fields, `stream`; `user`/`metadata` left out by the
policy's `ignore_fields`), stored, and answered from the cache the second time; a sampled one
(`temperature` > 0 without a seed) bypasses under `deterministic_only`; a streamed answer is
stored whole and replayed byte for byte. Then the semantic layer (the demo policies turn it on at
the shipped threshold): the same question written differently is an exact miss that a semantic
lookup may answer. It prints the Cache-Status each request got, and says a semantic hit only
when the filter answered one (`detail=semantic`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from meshcache.contract.filter_config import LLM_DEMO_POLICIES
from meshcache.contract.headers import CACHE_STATUS_HEADER
from meshcache.ctl.mesh.errors import MeshError

CHAT_PATH = "/v1/chat/completions"
# The similarity of a semantic hit's stored prompt to the request's (set with detail=semantic).
SIMILARITY_HEADER = "x-meshcache-similarity"
SEMANTIC_DETAIL = "detail=semantic"
INDEX_WAIT_S = 2.0  # how long the demo waits for the filter to index the first answer
# Words the demo draws fresh prompts from, so every run's first request is a miss.
_WORDS = ("river", "lantern", "copper", "meadow", "violin", "harbor", "pepper", "glacier", "orchid", "canyon",
          "falcon", "marble", "cedar", "ember", "quartz", "willow")


@dataclass
class Chat:
    """One chat completion as the caller saw it."""

    kind: str  # "chat" or "stream"
    model: str
    status: int
    cache_status: str
    ms: float
    text: str  # the answer's content (a stream's deltas joined)
    usage: dict[str, Any] | None
    events: list[str]  # a stream's `data:` payloads, in order ("[DONE]" included)
    body: bytes
    similarity: str = ""  # x-meshcache-similarity of a semantic hit

    @property
    def hit(self) -> bool:
        return "; hit" in self.cache_status

    @property
    def semantic_hit(self) -> bool:
        return self.hit and SEMANTIC_DETAIL in self.cache_status


def sse_events(body: bytes) -> list[str]:
    """The `data:` payloads of a text/event-stream body; raises ValueError unless every event is
    exactly `data: <payload>` followed by a blank line (what the engine sends)."""
    text = body.decode()
    if not text.endswith("\n\n"):
        raise ValueError(f"the stream does not end with a blank line: {text[-40:]!r}")
    events = []
    for block in text[:-2].split("\n\n"):
        if not block.startswith("data: ") or "\n" in block:
            raise ValueError(f"not one `data:` line: {block[:80]!r}")
        events.append(block.removeprefix("data: "))
    return events


def chat(http: httpx.Client, body: dict[str, Any], headers: dict[str, str] | None = None) -> Chat:
    """POST one chat completion (streamed if the body says so) and read the whole answer."""
    content = json.dumps(body).encode()
    t0 = time.perf_counter()
    r = http.post(CHAT_PATH, content=content, headers={"content-type": "application/json", **(headers or {})})
    ms = (time.perf_counter() - t0) * 1000
    stream = bool(body.get("stream"))
    text, usage, events = "", None, []
    if r.status_code == 200:
        if stream:
            events = sse_events(r.content)
            for payload in events:
                if payload == "[DONE]":
                    continue
                chunk = json.loads(payload)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
        else:
            answer = r.json()
            text, usage = answer["choices"][0]["message"]["content"], answer.get("usage")
    return Chat("stream" if stream else "chat", str(body.get("model", "")), r.status_code,
                r.headers.get(CACHE_STATUS_HEADER, "-"), ms, text, usage, events, r.content,
                r.headers.get(SIMILARITY_HEADER, ""))


def _row(c: Chat, note: str = "") -> Chat:
    tokens = f"{c.usage['prompt_tokens']}+{c.usage['completion_tokens']}" if c.usage else "-"
    print(f"{c.model:<16} {c.kind:<7} {'HIT' if c.hit else 'MISS':<5} {c.ms:>8.2f} ms  {tokens:>7}  "
          f"{c.cache_status}{'   ' + note if note else ''}", flush=True)
    return c


def _header(title: str) -> None:
    print(f"\n== {title}")
    print(f"{'model':<16} {'kind':<7} {'':<5} {'latency':>11}  {'tokens':>7}  Cache-Status")


def check_models(http: httpx.Client) -> None:
    r = http.get("/v1/models")
    names = {m["id"] for m in r.json().get("data", [])} if r.status_code == 200 else set()
    if not {"llama3-70b-demo", "gemma2-27b-demo"} <= names:
        raise MeshError("the mesh's engine serves no LLM demo models (they come with a mesh `meshcache demo --llm` "
                        "starts, or MeshConfig `llm: true` in `meshcache up --config`)")


def ensure_policies(policies: list[dict[str, Any]], put: Any) -> list[int]:
    """Put the LLM demo policies a running mesh lacks; the policy versions written."""
    have = {p["model_prefix"] for p in policies}
    return [put(prefix, spec)["version"] for prefix, spec in LLM_DEMO_POLICIES.items() if prefix not in have]


def _index_entries(semantic: httpx.Client | None) -> int | None:
    if semantic is None:
        return None
    try:
        return int(semantic.get("/v1/semantic/stats").json()["entries"])
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def _wait_indexed(semantic: httpx.Client | None, before: int | None) -> bool:
    """Whether the semantic index grew past `before` within INDEX_WAIT_S (the filter indexes a
    stored answer after answering it)."""
    deadline = time.monotonic() + INDEX_WAIT_S
    while before is not None:
        now = _index_entries(semantic)
        if now is not None and now > before:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return False


def _semantic_note(c: Chat) -> str:
    if c.semantic_hit:
        return f"semantic hit, similarity {c.similarity or '?'}"
    return "exact hit" if c.hit else "not answered by similarity"


def semantic_scenario(http: httpx.Client, semantic: httpx.Client | None, seed: int) -> list[Chat]:
    """The semantic layer: a question, then the same question in other letter case (a different
    body, so an exact miss). At the shipped threshold (0.999) only near-identical prompts match
    (docs/llm.md, "Precision"): the embedder is uncased, so case alone scores 1.0; a changed
    number must not match. Stream and non-stream are separate scopes, shown both."""
    words = [_WORDS[(seed >> (4 * i + 2)) % len(_WORDS)] for i in range(3)]
    question = f"what is special about the {words[0]} {words[1]} of {words[2]} ({seed % 100000})?"
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": question}]
    base = {"model": "llama3-70b-demo", "messages": messages, "temperature": 0, "max_tokens": 12}

    def asked(text: str, **extra: Any) -> dict[str, Any]:
        return {**base, **extra, "messages": [messages[0], {"role": "user", "content": text}]}

    out: list[Chat] = []
    for kind, extra in (("chat", {}), ("stream", {"stream": True, "stream_options": {"include_usage": True}})):
        _header(f"semantic layer ({kind}): a question, then the same question in capitals (an exact miss)")
        before = _index_entries(semantic)
        out.append(_row(chat(http, asked(question, **extra))))
        indexed = _wait_indexed(semantic, before)
        again = chat(http, asked(question.upper(), **extra))
        out.append(_row(again, _semantic_note(again)))
        if not indexed and not again.semantic_hit:
            print("   (the semantic index did not receive the first answer: this filter build makes no semantic "
                  "lookups yet, or its store is still in flight)")
        other = chat(http, asked(question.replace(f"({seed % 100000})", f"({seed % 100000 + 1})"), **extra))
        out.append(_row(other, "a changed number: " + _semantic_note(other)))
    hits = [c for c in out if c.semantic_hit]
    print(f"\n{len(hits)} of {len(out) // 3 * 2} reworded requests answered by similarity"
          + (f" (similarity {', '.join(c.similarity for c in hits)})" if hits else ""))
    return out


def scenario(http: httpx.Client, seed: int) -> list[Chat]:
    """The demo's requests and their table; returns what each request got."""
    words = [_WORDS[(seed >> (4 * i)) % len(_WORDS)] for i in range(4)]
    prompt = f"tell me about the {words[0]} {words[1]} near the {words[2]} {words[3]} ({seed % 100000})"
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]
    base = {"model": "llama3-70b-demo", "messages": messages, "temperature": 0, "max_tokens": 12}
    out: list[Chat] = []
    _header("a deterministic chat (temperature 0) twice: the engine, then the cache")
    out.append(_row(chat(http, base)))
    out.append(_row(chat(http, base), "same answer" if out[-1].text == out[0].text else "DIFFERENT ANSWER"))
    out.append(_row(chat(http, {**base, "user": "someone-else"}), "`user` is in ignore_fields"))
    _header("another model name, same messages: its own entry")
    out.append(_row(chat(http, {**base, "model": "gemma2-27b-demo"})))
    _header("stream: true is keyed apart from the non-streamed answer; the stream is stored whole and replayed")
    streamed = {**base, "stream": True, "stream_options": {"include_usage": True}}
    first = _row(chat(http, streamed))
    again = chat(http, streamed)
    out += [first, _row(again, "the first stream's bytes (its id and created too)" if again.body == first.body
                        else "other bytes than the first stream")]
    print(f"   {len(again.events)} SSE events, last {again.events[-1] if again.events else '-'!r}; deltas joined "
          f"{'equal' if again.text == out[0].text else 'differ from'} the non-streamed answer")
    _header("sampled answers bypass under deterministic_only; a fixed seed makes them cacheable")
    sampled = {**base, "temperature": 0.8}
    out.append(_row(chat(http, sampled)))
    out.append(_row(chat(http, {**sampled, "seed": 7})))
    out.append(_row(chat(http, {**sampled, "seed": 7})))
    hits = [c for c in out if c.hit]
    saved = sum(c.usage["prompt_tokens"] + c.usage["completion_tokens"] for c in hits if c.usage)
    print(f"\n{len(hits)}/{len(out)} answered by the cache; {saved} prompt+completion tokens the engine did not "
          f"read or write")
    return out
