"""Differential test of the filter's request reading against the servers' (a seeded generator).

A few hundred generated requests, each sent twice through a real Envoy with the built filter to
the test origin, which answers with what a server reads from those exact bytes
(`server_reading`: Python's json, the engine's binary-extension rule, protobuf). Bodies repeat
and shuffle JSON members (`model` twice, escaped keys, odd types, whitespace, ids, nested
`model`s, ignored fields), vary `x-model-id`, `x-model-version` and the path's spelling, the binary-extension
header, and protobuf ModelInferRequest fields (repeated, wrong wire types, unknown fields,
compression). The rule: either the filter stays out, or the answer it serves is the server's
answer to these bytes, under the policy of the model the server reads.
- A hit must carry the `read` of this request (else the key joined requests the server reads
  differently), and is never served where the server refuses the request.
- A hit's TTL names the policy it was stored under (each policy has its own TTL): it must be the
  policy of the model the server reads; a model without an enabled policy is never cached.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from tests.filter import server_reading
from tests.filter.stack import config, filter_stack, policy
from tests.helpers.kserve import MODEL_INFER

SEED = 22
REST_REQUESTS = 600
GRPC_REQUESTS = 200
# Each policy its own TTL, so a hit's `ttl=` says which policy it was stored under.
TTLS = {"alpha": 1000, "beta": 2000, "gamma": 3000}
POLICIES = [policy(name, ttl_s=ttl, ignore_fields=list(server_reading.IGNORED_FIELDS)) for name, ttl in TTLS.items()]
POLICIES.append(policy("omega", enabled=False))
NAMES = ["alpha", "beta", "gamma", "delta", "omega"]


def _policy_of(model: object) -> str | None:
    """The enabled policy the server's model falls under (longest prefix), if any."""
    if not isinstance(model, str):
        return None
    matches = [p for p in TTLS if model.startswith(p)]
    return max(matches, key=len) if matches else None


def _policy_from_ttl(cache_status: str) -> str:
    ttl = int(cache_status.split("ttl=", 1)[1].split(";", 1)[0])
    found = [name for name, t in TTLS.items() if t - 60 <= ttl <= t]
    assert len(found) == 1, cache_status
    return found[0]


# ---- REST requests -------------------------------------------------------------------------

MODEL_VALUES = ['"alpha"', '"beta"', '"gamma"'] * 4 + [
    '"delta"', '"omega"', '"alph\\u0061"', '"gam\\u006da"', '""', "3", "null", '["alpha"]', '{"name": "alpha"}', "true",
    '"\\udc00"', '"alpha "']
MODEL_KEYS = ['"model"', '"model"', '"model"', '"mo\\u0064el"', '"Model"']
OTHER_MEMBERS = [
    ('"messages"', '[{"role": "user", "content": "hi", "model": "beta"}]'),
    ('"messages"', '[{"role": "user", "content": "h\\u0069"}]'),
    ('"temperature"', "0"), ('"temperature"', "0.0"),
    ('"user"', '"u1"'), ('"user"', '"u2"'),
    ('"id"', '"r-1"'), ('"id"', '"r-2"'), ('"id"', "5"), ('"i\\u0064"', '"r-3"'),
    ('"inputs"', "[1]"), ('"inputs"', "[2]"), ('"inputs"', '[{"name": "x", "data": [1.5]}]'),
    ('"parameters"', '{"model": "gamma"}'),
]
WHITESPACE = ["", "", " ", "\n", "\t", "  "]
MODEL_VERSIONS = ["1", "1", "2", "2", "", "3"]


@dataclass
class RestRequest:
    path: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


def _json_object(rng: random.Random, members: list[tuple[str, str]]) -> str:
    ws = lambda: rng.choice(WHITESPACE)  # noqa: E731 - a one-line helper local to this builder
    inner = ("," + ws()).join(f"{ws()}{k}{ws()}:{ws()}{v}{ws()}" for k, v in members)
    return f"{ws()}{{{inner}}}{ws()}"


def _corrupt(rng: random.Random, text: str) -> str:
    return rng.choice([text[:-2], text.replace("}", ",}", 1), text.replace("0", "NaN", 1), "\ufeff" + text,
                       text + "}", text.replace('"', "'", 1)])


def rest_request(rng: random.Random) -> RestRequest:
    kind = rng.choices(["chat", "completions", "embeddings", "kserve", "header", "odd-path"],
                       weights=[30, 5, 5, 35, 10, 10])[0]
    members: list[tuple[str, str]] = []
    for _ in range(rng.choices([0, 1, 2], weights=[15, 72, 13])[0]):
        members.append((rng.choice(MODEL_KEYS), rng.choice(MODEL_VALUES)))
    for _ in range(rng.randint(0, 3)):
        members.append(rng.choice(OTHER_MEMBERS))
    rng.shuffle(members)
    text = _json_object(rng, members)
    if rng.random() < 0.08:
        text = _corrupt(rng, text)
    body = text.encode("utf-8", "surrogatepass")
    headers: list[tuple[str, str]] = []
    for _ in range(rng.choices([0, 1, 2], weights=[70, 27, 3])[0]):
        headers.append(("x-model-id", rng.choice(NAMES)))
    # x-model-version picks the version on /v1/infer (the engine), and is keyed everywhere.
    for _ in range(rng.choices([0, 1, 2], weights=[60, 37, 3])[0]):
        headers.append((rng.choice(["x-model-version", "X-Model-Version"]), rng.choice(MODEL_VERSIONS)))
    if kind == "kserve":
        name = rng.choice(NAMES)
        path = f"/v2/models/{name}/infer" if rng.random() < 0.9 else f"/v2/models/{name}/versions/2/infer"
        if rng.random() < 0.35:
            n = len(body)
            body += bytes([1, 2, rng.randint(0, 3)])
            value = rng.choice([str(n), str(n), f"+{n}", f"0{n}", str(n + 1), str(n - 1), f"{n}.0", f"{n}x", "-1"])
            headers.append((server_reading.BINARY_HEADER, value))
            if rng.random() < 0.15:
                headers.append((server_reading.BINARY_HEADER, rng.choice([str(n), str(n + 2)])))
    elif kind == "header":
        path = "/v1/infer"
        if not any(k == "x-model-id" for k, _ in headers):  # the only place it names the model
            headers.append(("x-model-id", rng.choice(NAMES)))
    elif kind == "odd-path":
        path = rng.choice(["/v1/chat/completions/", "//v1/chat/completions", "/V1/chat/completions",
                           "/v1/chat/%63ompletions", "/v2/models/%61lpha/infer", "/v1//embeddings"])
    else:
        path = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}[kind]
    headers.append(("x-origin-read", "1"))
    return RestRequest(path, headers, body)


def rest_variant(rng: random.Random, p: RestRequest) -> RestRequest:
    """Another request close to `p`: another id or ignored field value (the key may join them),
    one more `model` member or another `x-model-version` (it must not)."""
    body = p.body
    if rng.random() < (0.6 if p.path == "/v1/infer" else 0.1):
        headers = [h for h in p.headers if h[0].lower() != "x-model-version"]
        if rng.random() < 0.8:
            headers.insert(0, ("x-model-version", rng.choice(MODEL_VERSIONS)))
        return RestRequest(p.path, headers, body)
    if rng.random() < 0.75:
        swaps = [(b'"r-1"', b'"r-2"'), (b'"r-2"', b'"r-1"'), (b'"u1"', b'"u2"'), (b'"u2"', b'"u1"')]
        rng.shuffle(swaps)
        for old, new in swaps:
            if old in body:
                body = body.replace(old, new, 1)
                break
    elif (end := body.rfind(b"}")) > 0:
        body = body[:end] + b', "model": ' + rng.choice(MODEL_VALUES).encode() + body[end:]
    return RestRequest(p.path, list(p.headers), body)


# ---- gRPC requests -------------------------------------------------------------------------

def _field(number: int, payload: bytes) -> bytes:
    return server_reading.varint(number << 3 | 2) + server_reading.varint(len(payload)) + payload


def grpc_request(rng: random.Random) -> bytes:
    fields: list[bytes] = []
    for _ in range(rng.choices([0, 1, 2], weights=[10, 70, 20])[0]):
        fields.append(_field(1, rng.choice([b"alpha", b"beta", b"gamma", b"delta", b"omega", b"", b"alph\xff"])))
    if rng.random() < 0.3:
        fields.append(_field(2, rng.choice([b"1", b"2"])))
    for _ in range(rng.choices([0, 1, 2], weights=[40, 45, 15])[0]):
        fields.append(_field(3, rng.choice([b"g-1", b"g-2", b""])))
    fields.append(_field(5, _field(1, rng.choice([b"x", b"y"]))))  # inputs[0].name
    if rng.random() < 0.15:
        fields.append(rng.choice([b"\x08\x01",  # field 1 as a varint: another wire type
                                  b"\x50\x07",  # unknown field 10, varint
                                  _field(15, b"z" * 300)]))  # unknown, long (compressible)
    rng.shuffle(fields)
    return b"".join(fields)


# ---- the test ------------------------------------------------------------------------------

def _check_rest(req: RestRequest, r: httpx.Response, tally: Counter[str]) -> None:
    status = r.headers.get("cache-status", "")
    tally[status.split("; ttl=")[0]] += 1
    # The path as the origin got it: Python's http.server merges leading slashes (`//v1/...` is
    # routed as `/v1/...`), as routers may; the key holds the path, so a hit's is this one's too.
    path = r.json().get("path", req.path) if r.status_code in (200, 400) else req.path
    try:
        read: dict[str, Any] | None = server_reading.read_rest(path, req.headers, req.body)
    except server_reading.Unreadable:
        read = None
    served = status.startswith("meshcache; hit")
    if read is None:
        assert not served and r.status_code == 400, (req, status, r.status_code)
        return
    assert r.status_code == 200, (req, r.text)
    assert r.json()["read"] == read, f"the filter served another request's answer: {req} {status}"
    if served:
        assert _policy_from_ttl(status) == _policy_of(read["model"]), (req, status, read)


def _check_grpc(message: bytes, answer: bytes | None, code: grpc.StatusCode, status: str,
                tally: Counter[str]) -> None:
    tally["grpc " + status.split("; ttl=")[0]] += 1
    served = status.startswith("meshcache; hit")
    try:
        parsed = server_reading.read_grpc(message)
    except server_reading.Unreadable:
        assert not served and code == grpc.StatusCode.INVALID_ARGUMENT, (message, status, code)
        return
    assert code == grpc.StatusCode.OK, (message, code)
    assert answer == server_reading.grpc_answer(parsed), f"another request's answer: {message!r} {status}"
    if served:
        assert _policy_from_ttl(status) == _policy_of(parsed.model_name), (message, status)


def test_the_filter_reads_requests_as_the_servers_do_or_stays_out(tmp_path: Path, host: str) -> None:
    rng = random.Random(SEED)
    rest: list[RestRequest] = []
    for _ in range(REST_REQUESTS):
        rest.append(rest_variant(rng, rng.choice(rest)) if rest and rng.random() < 0.3 else rest_request(rng))
    grpc_requests = [(grpc_request(rng), rng.random() < 0.1) for _ in range(GRPC_REQUESTS)]
    tally: Counter[str] = Counter()
    with filter_stack(tmp_path, config(*POLICIES), host=host) as s, httpx.Client(timeout=10) as c:
        for req in rest:
            for n in range(2):  # the second one hits when the first was stored: its TTL names the policy
                r = c.post(s.url(req.path), content=req.body, headers=req.headers)
                _check_rest(req, r, tally)
                tally["first-send hit"] += n == 0 and r.headers.get("cache-status", "").startswith("meshcache; hit")
        plain = grpc.insecure_channel(f"127.0.0.1:{s.listen_port}")
        gzip = grpc.insecure_channel(f"127.0.0.1:{s.listen_port}", compression=grpc.Compression.Gzip)
        try:
            for message, compressed in grpc_requests:
                call = (gzip if compressed else plain).unary_unary(MODEL_INFER)
                for n in range(2):
                    try:
                        answer, done = call.with_call(message, timeout=10)
                    except grpc.RpcError as err:
                        answer, done = None, err
                    # A trailers-only answer (an error) carries the headers in the trailing metadata.
                    md = {**dict(done.trailing_metadata() or ()), **dict(done.initial_metadata() or ())}
                    _check_grpc(message, answer, done.code(), md.get("cache-status", ""), tally)
                    tally["grpc first-send hit"] += n == 0 and md.get("cache-status", "").startswith("meshcache; hit")
        finally:
            plain.close()
            gzip.close()
    # The generator reaches what it is meant to: hits across requests, and each way to stay out.
    # (Hits on a first send are answers stored for another request the key joins with this one.)
    assert tally["meshcache; hit"] >= 100 and tally["grpc meshcache; hit"] >= 50, tally
    assert tally["first-send hit"] >= 10 and tally["grpc first-send hit"] >= 10, tally
    for detail in ("ambiguous-model", "binary-length", "path", "model-conflict", "no-policy", "disabled",
                   "unparsable", "no-model"):
        assert tally[f"meshcache; fwd=bypass; detail={detail}"] > 0, (detail, tally)
    assert tally["grpc meshcache; fwd=bypass; detail=unparsable"] > 0, tally
