"""OpenAI-compatible chat completions from the real engine (its LLM demo models) through a real
Envoy running the cache, on both hosts: what the cache does with LLM traffic today (issue 38,
docs/llm.md). A deterministic chat is stored and hit; the body's model, `stream` flag and
sampling fields are keyed; `ignore_fields` leaves `user` out; a sample, `n > 1` and offered tools
bypass under `deterministic_only`; a streamed answer goes through at once, is stored whole and a
hit replays its exact bytes (valid SSE ending `data: [DONE]`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshcache.contract.filter_config import LLM_DEMO_POLICIES
from meshcache.ctl import launchers
from meshcache.ctl.launchers import Engine
from meshcache.ctl.mesh.demo_llm import chat
from tests.engine.helpers import running_engine
from tests.filter.stack import config, filter_stack

HIT = "meshcache; hit"
STORED = "meshcache; fwd=miss; stored"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    repo = launchers.init_demo_models(tmp_path_factory.mktemp("models"), llm=True)
    with running_engine(repo, tmp_path_factory.mktemp("engine-logs")) as e:
        yield e


def _policies() -> dict[str, Any]:
    return config(*({"model_prefix": prefix, **spec} for prefix, spec in LLM_DEMO_POLICIES.items()))


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "llama3-70b-demo", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "what is a lantern for"}], **fields}


def test_chat_completion_miss_then_hit(tmp_path: Path, engine: Engine, host: str) -> None:
    with filter_stack(tmp_path, _policies(), upstream=(engine.http_port, engine.grpc_port), host=host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        first = chat(http, _body())
        assert (first.status, first.cache_status) == (200, STORED), first.body
        again = chat(http, _body())
        assert again.cache_status.startswith(HIT)
        assert again.body == first.body, "a hit is the stored answer (its id and created too)"
        # `user` is in the policy's ignore_fields: same entry. The model name, the system prompt,
        # a sampling field: other entries, the engine's own answers.
        assert chat(http, _body(user="u-2")).cache_status.startswith(HIT)
        other_model = chat(http, _body(model="gemma2-27b-demo"))
        assert other_model.cache_status == STORED
        assert json.loads(other_model.body)["model"] == "gemma2-27b-demo"
        for changed in (_body(messages=[{"role": "system", "content": "be long"},
                                        {"role": "user", "content": "what is a lantern for"}]),
                        _body(max_tokens=9), _body(seed=3)):
            assert chat(http, changed).cache_status == STORED
        # A sample bypasses under deterministic_only; a fixed seed makes it one answer, cached.
        assert chat(http, _body(temperature=0.7)).cache_status == "meshcache; fwd=bypass; detail=nondeterministic"
        seeded = chat(http, _body(temperature=0.7, seed=11))
        assert seeded.cache_status == STORED
        assert chat(http, _body(temperature=0.7, seed=11)).body == seeded.body


def test_several_choices_and_tools_bypass_under_deterministic_only(tmp_path: Path, engine: Engine, host: str) -> None:
    with filter_stack(tmp_path, _policies(), upstream=(engine.http_port, engine.grpc_port), host=host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        tool = {"type": "function", "function": {"name": "light", "parameters": {"type": "object"}}}
        # Even greedy: n > 1 hands every caller the first caller's set of answers, a tool call
        # its call ids. Each bypass says why, whatever the engine answers (it refuses tools).
        for body, detail in ((_body(n=2), "multiple-choices"), (_body(tools=[tool]), "tool-calls"),
                             (_body(n=2, temperature=0.7, seed=4), "multiple-choices")):
            for _ in range(2):
                assert chat(http, body).cache_status == f"meshcache; fwd=bypass; detail={detail}"
        # No tools offered and one choice are the plain deterministic request: cached.
        assert chat(http, _body(n=1, tools=[])).cache_status == STORED
        s.stats_reaching({"meshcache.bypass.multiple-choices": 4, "meshcache.bypass.tool-calls": 2})


def test_stream_stored_whole_and_replayed_apart_from_non_stream(tmp_path: Path, engine: Engine, host: str) -> None:
    with filter_stack(tmp_path, _policies(), upstream=(engine.http_port, engine.grpc_port), host=host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        plain = chat(http, _body())
        assert plain.cache_status == STORED
        streamed = _body(stream=True, stream_options={"include_usage": True})
        first = chat(http, streamed)
        # Not answered by the non-streamed entry: `stream` is in the key. An event stream is never
        # held, so its headers cannot say `stored`.
        assert first.cache_status == "meshcache; fwd=miss", first.cache_status
        assert first.events[-1] == "[DONE]" and first.text == plain.text and first.usage == plain.usage
        again = chat(http, streamed)
        assert again.cache_status.startswith(HIT), again.cache_status
        assert again.body == first.body, "the stored stream, byte for byte"
        assert again.events == first.events  # sse_events checked every event boundary
        # And the stream's entry does not answer the non-streamed request either.
        assert chat(http, _body()).body == plain.body
