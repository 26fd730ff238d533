"""The scope vectors the filter's Rust scope is checked against (filter/core/src/semantic.rs):
request bodies as sent, the scope's inputs, and what `meshcache/semantic/scope.py` computes.
`python -m tests.semantic.scope_vectors` rewrites scope_vectors.json after a change to the
reference; test_scope_contract.py fails until it is rewritten."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshcache.semantic.scope import NotEligible, semantic_scope

PATH = Path(__file__).with_name("scope_vectors.json")

_SYSTEM = {"role": "system", "content": "You are a support agent.\n\"Be brief\"\t\u00e9\u4e2d\U0001f600\x01"}
_FRANCE = "What is the capital of France?"
_TOOL = {"type": "function",
         "function": {"name": "f", "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}}}
_TWO_PARTS = {"role": "user", "name": "bob",
              "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}
_CASES: list[tuple[str, dict[str, Any]]] = [
    ('{"model":"llama3-70b-demo","messages":[{"role":"user","content":"' + _FRANCE + '"}],"temperature":0}', {}),
    # Key order, spaces and escapes as sent do not matter (canonical JSON).
    ('{ "temperature" : 0 , "messages" : [ {"content":"' + _FRANCE + '","role":"user"} ],'
     ' "model" : "llama3-70b-demo" }',
     {}),
    ('{"model":"llama3-70b-demo","messages":[{"role":"user","content":"\\u0057' + _FRANCE[1:] + '"}],"temperature":0}',
     {}),
    (json.dumps({"model": "gemma2-27b-demo", "messages": [_SYSTEM, {"role": "user", "content": "hi"}],
                 "temperature": 0.7, "seed": 42, "top_p": 1e-05, "max_tokens": 17, "frequency_penalty": 1.5e16,
                 "presence_penalty": -0.0}), {}),
    (json.dumps({"model": "m", "messages": [_SYSTEM, {"role": "user", "content": "a"},
                                            {"role": "assistant", "content": "b"}, _TWO_PARTS],
                 "stream": True, "stream_options": {"include_usage": True}, "user": "alice",
                 "metadata": {"x": [1, 2.5, None]}}),
     {"ignore_fields": ["user", "metadata"]}),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [_TOOL],
                 "response_format": {"type": "json_object"}}),
     {"principal": "spiffe://cluster.local/ns/a/sa/web", "generation": 3}),
    ('{"model":"m","messages":[{"role":"user","content":"hi"}],"n":12345678901234,"logit_bias":{"50256":-100}}',
     {"instance": "another-sidecar"}),
    # No scope: the last message is not a user text.
    ('{"model":"m","messages":[{"role":"assistant","content":"hi"}]}', {}),
    ('{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}', {}),
    ('{"model":"m","messages":[]}', {}),
]


def vectors() -> list[dict[str, Any]]:
    out = []
    for body, args in _CASES:
        inputs = {"policy": "llama3-", "generation": 0, "principal": None, "ignore_fields": [],
                  "instance": "0f" * 16} | args
        try:
            scope, text = semantic_scope(json.loads(body), inputs["policy"], inputs["generation"], inputs["principal"],
                                         tuple(inputs["ignore_fields"]), inputs["instance"])
        except NotEligible:
            scope, text = None, None
        out.append({"body": body, **inputs, "scope": scope, "text": text})
    return out


if __name__ == "__main__":
    PATH.write_text(json.dumps(vectors(), indent=1, ensure_ascii=False) + "\n")
