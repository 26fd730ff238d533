"""KServe request ids in a real Envoy with the test origin (which echoes ids as a KServe server
does): the key leaves the id out, hits carry the caller's own id, the hash ignores it; OpenAI
`ignore_fields` and `deterministic_only`; bodies the key cannot read bypass."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx

from meshcache.ctl.procs import local_http
from tests.filter.stack import SharedStacks, config, filter_stack, infer_request, policy
from tests.helpers.kserve import MODEL_INFER

INFER = "/v2/models/m/infer"
INPUTS = [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]
UNPARSABLE = "meshcache; fwd=bypass; detail=unparsable"
UUID = "4f1c2a9e-77d0-4c43-9a56-0c6f1b2e8d31"


def rest_body(request_id: str | None, inputs: list[dict] = INPUTS) -> bytes:
    body: dict = {"inputs": inputs}
    if request_id is not None:
        body = {"id": request_id, **body}
    return json.dumps(body).encode()


def test_rest_hit_answers_with_the_callers_id(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(), host=host) as s, httpx.Client() as c:
        first = c.post(s.url(INFER), content=rest_body("req-a"))
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert first.json()["id"] == "req-a"
        second = c.post(s.url(INFER), content=rest_body(UUID))
        assert second.headers["cache-status"].startswith("meshcache; hit; ttl=")
        assert s.origin_calls()["http"] == 1, "the hit did not reach the origin"
        # Byte for byte what the origin answers that id (asked directly, past Envoy).
        direct = local_http().post(f"http://127.0.0.1:{s.http_port}{INFER}", content=rest_body(UUID))
        assert second.content == direct.content
        assert second.json()["id"] == UUID
        # The hash and the ETag cover the answer without its id: the same for every caller.
        assert second.headers["x-response-hash"] == first.headers["x-response-hash"]
        assert second.headers["etag"] == first.headers["etag"]
        third = c.post(s.url(INFER), content=rest_body("x"), headers={"if-none-match": first.headers["etag"]})
        assert third.status_code == 304
        # The id may sit anywhere in the request, even spelled with escapes: the key is the body
        # as if it had been sent without the id.
        later = c.post(s.url(INFER), content=b'{"inputs": ' + json.dumps(INPUTS).encode() + b', "\\u0069d": "last"}')
        assert later.headers["cache-status"].startswith("meshcache; hit")
        assert later.json()["id"] == "last"
        assert later.content == direct.content.replace(UUID.encode(), b"last")
        assert s.origin_calls()["http"] == 2, "one miss and the direct call"
        s.stats_reaching({"meshcache.hits": 3})


def test_no_id_in_means_no_id_out(shared_stacks: SharedStacks, host: str) -> None:
    s = shared_stacks.get(config(), host)
    infer = s.infer_url("m")
    with httpx.Client() as c:
        with_id = c.post(infer, content=rest_body("first"))
        assert with_id.headers["cache-status"] == "meshcache; fwd=miss; stored"
        # Same inputs without an id: the answer stored with an id must not serve it.
        plain = c.post(infer, content=rest_body(None))
        assert plain.headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert "id" not in plain.json()
        plain_hit = c.post(infer, content=rest_body(None))
        assert plain_hit.headers["cache-status"].startswith("meshcache; hit")
        assert plain_hit.content == plain.content
        assert "id" not in plain_hit.json()
        id_hit = c.post(infer, content=rest_body("second"))
        assert id_hit.headers["cache-status"].startswith("meshcache; hit")
        assert id_hit.json()["id"] == "second"
        assert s.origin_calls()["http"] == 2


def test_ids_the_filter_cannot_reencode_are_cached_per_id(shared_stacks: SharedStacks, host: str) -> None:
    s = shared_stacks.get(config(), host)
    with httpx.Client() as c:
        for request_id in ("caf\u00e9", "with space", ""):
            first = c.post(s.infer_url("m"), content=rest_body(request_id))
            assert first.headers["cache-status"] == "meshcache; fwd=miss; stored", request_id
            again = c.post(s.infer_url("m"), content=rest_body(request_id))
            assert again.headers["cache-status"].startswith("meshcache; hit"), request_id
            assert again.content == first.content
        assert s.origin_calls()["http"] == 3


def test_malformed_bodies_bypass(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(), host=host) as s, httpx.Client() as c:
        bad = [
            b'{"id": "a", "inputs": [',
            b'{"id": "a", "id": "b", "inputs": []}',
            b'{"id": 7, "inputs": []}',
            b"not json",
            b'{"inputs": [1,]}',
            b'{"id": "\\ud800", "inputs": []}',
        ]
        for body in bad:
            for _ in range(2):
                r = c.post(s.url(INFER), content=body)
                assert r.headers["cache-status"] == UNPARSABLE, body
        assert s.origin_calls()["http"] == 2 * len(bad), "bypassed requests all reach the origin"
        s.stats_reaching({"meshcache.bypasses": 2 * len(bad)})


def test_binary_extension_length_past_the_body_bypasses(shared_stacks: SharedStacks, host: str) -> None:
    s = shared_stacks.get(config(), host)
    with httpx.Client() as c:
        r = c.post(s.infer_url("m"), content=rest_body("q"), headers={"inference-header-content-length": "9999"})
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=binary-length"


def test_grpc_hit_answers_with_the_callers_id(shared_stacks: SharedStacks, host: str) -> None:
    s = shared_stacks.get(config(policy("resnet")), host)
    first, call1 = s.grpc_infer(infer_request(s.model("resnet-mini"), request_id=b"grpc-1"))
    md1 = dict(call1.initial_metadata())
    assert md1["cache-status"] == "meshcache; fwd=miss; stored"
    assert b"grpc-1" in first
    request = infer_request(s.model("resnet-mini"), request_id=b"a-much-longer-request-id-0002")
    second, call2 = s.grpc_infer(request)
    md2 = dict(call2.initial_metadata())
    assert md2["cache-status"].startswith("meshcache; hit; ttl=")
    assert s.origin_calls()["grpc"] == 1
    with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as ch:
        direct = ch.unary_unary(MODEL_INFER)(request, timeout=10)
    assert second == direct, "byte for byte what the origin answers that id"
    assert md2["x-response-hash"] == md1["x-response-hash"]
    # No id in, no id out; such requests get their own entry.
    plain, call3 = s.grpc_infer(infer_request(s.model("resnet-mini")))
    assert dict(call3.initial_metadata())["cache-status"] == "meshcache; fwd=miss; stored"
    assert b"\x1a" not in plain[: plain.index(b"\x2a")]
    plain_hit, call4 = s.grpc_infer(infer_request(s.model("resnet-mini")))
    assert dict(call4.initial_metadata())["cache-status"].startswith("meshcache; hit")
    assert plain_hit == plain
    # Repeated id fields: the last one is the id (protobuf semantics), and it is echoed.
    twice = infer_request(s.model("resnet-mini"), request_id=b"old") + b"\x1a\x03new"
    answer, call5 = s.grpc_infer(twice)
    assert dict(call5.initial_metadata())["cache-status"].startswith("meshcache; hit")
    assert b"\x1a\x03new" in answer and b"old" not in answer
    assert s.origin_calls()["grpc"] == 3, "two misses and the direct call"


def test_grpc_malformed_requests_bypass(shared_stacks: SharedStacks, host: str) -> None:
    s = shared_stacks.get(config(policy("resnet")), host)
    # Field 3 (id) sent as a varint: a protobuf parser would not read it as the id.
    odd = infer_request(s.model("resnet-mini")) + b"\x18\x05"
    for _ in range(2):
        try:
            _, call = s.grpc_infer(odd)
            status = dict(call.initial_metadata()).get("cache-status")
        except grpc.RpcError as exc:
            status = dict(exc.initial_metadata()).get("cache-status")
        assert status == UNPARSABLE


def test_openai_ignore_fields_and_deterministic_only(tmp_path: Path, host: str) -> None:
    cfg = config(policy("gpt", ignore_fields=["user", "metadata"], deterministic_only=True))
    chat = "/v1/chat/completions"

    def body(**fields: object) -> bytes:
        return json.dumps({"model": "gpt-mini", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()

    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client() as c:
        first = c.post(s.url(chat), content=body(temperature=0, user="alice"))
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
        other_user = c.post(s.url(chat), content=body(temperature=0, user="bob", metadata={"trace": "t-1"}))
        assert other_user.headers["cache-status"].startswith("meshcache; hit")
        assert other_user.content == first.content
        different = c.post(s.url(chat), content=body(temperature=0, user="bob", top_p=0.5))
        assert different.headers["cache-status"] == "meshcache; fwd=miss; stored", "other fields still key"
        for sampled in (body(temperature=0.7), body(), body(temperature=1, seed=None)):
            for _ in range(2):
                r = c.post(s.url(chat), content=sampled)
                assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=nondeterministic"
        seeded = [c.post(s.url(chat), content=body(temperature=0.7, seed=42)) for _ in range(2)]
        assert seeded[1].headers["cache-status"].startswith("meshcache; hit")
        assert s.origin_calls()["http"] == 2 + 6 + 1
        # Only a non-negative integer seed makes a sample repeatable: anything else is a sample
        # (llama.cpp-style servers read -1, and 4294967295, as "pick a random seed").
        for seed in (False, "x", {}, 1.5, [7], -1, -7, 4294967295):
            for _ in range(2):
                r = c.post(s.url(chat), content=body(temperature=0.7, seed=seed))
                assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=nondeterministic", seed
        assert s.origin_calls()["http"] == 2 + 6 + 1 + 16
        zero = [c.post(s.url(chat), content=body(temperature=0.7, seed=0)) for _ in range(2)]
        assert zero[1].headers["cache-status"].startswith("meshcache; hit"), "0 is a fixed seed"
