"""The two hosts of the cache core decide alike (issue 32): the same seeded corpus goes through a
real Envoy running the proxy-wasm filter and a real Envoy running the dynamic module, each in
front of its own test origin, in the same order; every answer must be byte-equal and carry the
same `Cache-Status` (without `ttl=`, which counts seconds), status and `x-response-hash`.

The corpus: REST requests from the request-reading differential's generator (OpenAI-style and
KServe bodies, `x-model-id`/`x-model-version` lines, odd paths), gRPC ModelInferRequests (some
compressed), HTTP/2 POSTs whose body ends with trailers, and header variants of `/v1/infer`
(model version, repeated or mixed-case lines, client `Cache-Control`). Each request is sent
twice, so the second one shows whether both hosts stored the first alike.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from tests.filter.stack import HOSTS, Stack, config, filter_stack
from tests.filter.test_differential import POLICIES, RestRequest, grpc_request, rest_request, rest_variant
from tests.helpers.http2 import post_with_trailers
from tests.helpers.kserve import MODEL_INFER

SEED = 32
REST_REQUESTS = 160
GRPC_REQUESTS = 50
TRAILER_REQUESTS = 40


@dataclass(frozen=True)
class Seen:
    """What one host answered, as compared: everything but `ttl=` and `Age` (wall-clock seconds)."""
    status: str
    body: bytes
    cache_status: str
    response_hash: str | None


def _cache_status(value: str | None) -> str:
    return re.sub(r";\s*ttl=-?\d+", "", value or "")


@dataclass
class Case:
    kind: str  # rest, grpc, h2-trailers
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    compressed: bool = False


def _rest(s: Stack, c: httpx.Client, case: Case) -> Seen:
    r = c.post(s.url(case.path), content=case.body, headers=case.headers)
    return Seen(str(r.status_code), r.content, _cache_status(r.headers.get("cache-status")),
                r.headers.get("x-response-hash"))


def _grpc(channels: dict[bool, grpc.Channel], case: Case) -> Seen:
    call = channels[case.compressed].unary_unary(MODEL_INFER)
    try:
        answer, done = call.with_call(case.body, metadata=tuple(case.headers), timeout=10)
    except grpc.RpcError as err:
        answer, done = b"", err
    md = {**dict(done.trailing_metadata() or ()), **dict(done.initial_metadata() or ())}
    return Seen(done.code().name, answer or b"", _cache_status(md.get("cache-status")), md.get("x-response-hash"))


def _h2(s: Stack, case: Case) -> Seen:
    headers = [(k.lower(), v) for k, v in case.headers] + [("content-length", str(len(case.body)))]
    a = post_with_trailers(s.listen_port, case.path, headers, case.body, [("x-checksum", "trailer-ends-the-body")])
    assert not a.reset, case
    return Seen(str(a.status), a.body, _cache_status(a.header("cache-status")), a.header("x-response-hash"))


def _header_variants(rng: random.Random) -> list[Case]:
    """`/v1/infer` requests that differ only in headers: the model's version, lines repeated or
    in another case, and the client's Cache-Control."""
    cases = []
    for i in range(30):
        body = f'{{"input": [{rng.randint(0, 3)}], "shape": [1]}}'.encode()
        headers = [("x-model-id", rng.choice(["alpha", "beta", "omega", "zeta"])), ("x-origin-read", "1")]
        for _ in range(rng.choices([0, 1, 2], weights=[30, 60, 10])[0]):
            headers.append((rng.choice(["x-model-version", "X-Model-Version"]), rng.choice(["1", "2", ""])))
        if rng.random() < 0.2:
            headers.append(("cache-control", rng.choice(["no-cache", "max-age=0", "max-age=60", "no-store"])))
        cases.append(Case("rest", "/v1/infer", headers, body))
        if i % 3 == 0:
            cases.append(Case("h2-trailers", "/v1/infer", headers, body))
    return cases


def _corpus() -> list[Case]:
    rng = random.Random(SEED)
    rest: list[RestRequest] = []
    for _ in range(REST_REQUESTS):
        rest.append(rest_variant(rng, rng.choice(rest)) if rest and rng.random() < 0.3 else rest_request(rng))
    cases = [Case("rest", r.path, r.headers, r.body) for r in rest]
    # HTTP/2 with trailers: requests the REST generator made, the same bytes ended by trailers.
    cases += [Case("h2-trailers", r.path, r.headers, r.body) for r in rng.sample(rest, TRAILER_REQUESTS)]
    cases += [Case("grpc", MODEL_INFER, [], grpc_request(rng), rng.random() < 0.1) for _ in range(GRPC_REQUESTS)]
    cases += _header_variants(rng)
    rng.shuffle(cases)
    return cases


def test_the_wasm_and_native_hosts_answer_the_same_corpus_alike(tmp_path: Path) -> None:
    cases = _corpus()
    seen: dict[str, list[Seen]] = {}
    for host in HOSTS:
        (tmp_path / host).mkdir()
        with filter_stack(tmp_path / host, config(*POLICIES), host=host) as s, httpx.Client(timeout=10) as c:
            channels = {False: grpc.insecure_channel(f"127.0.0.1:{s.listen_port}"),
                        True: grpc.insecure_channel(f"127.0.0.1:{s.listen_port}", compression=grpc.Compression.Gzip)}
            try:
                answers = []
                for case in cases:
                    for _ in range(2):
                        if case.kind == "grpc":
                            answers.append(_grpc(channels, case))
                        elif case.kind == "h2-trailers":
                            answers.append(_h2(s, case))
                        else:
                            answers.append(_rest(s, c, case))
                seen[host] = answers
            finally:
                for ch in channels.values():
                    ch.close()
    sent = [case for case in cases for _ in range(2)]
    differ = [(case, w, n) for case, w, n in zip(sent, seen["wasm"], seen["native"], strict=True) if w != n]
    assert not differ, f"{len(differ)} of {len(sent)} answers differ between the hosts; first: {differ[:3]}"
    # The corpus reaches what it is meant to, on each kind of request: stores and hits.
    tally = Counter((case.kind, a.cache_status.split(";")[1].strip() if ";" in a.cache_status else a.cache_status)
                    for case, a in zip(sent, seen["wasm"], strict=True))
    for kind in ("rest", "grpc", "h2-trailers"):
        assert tally[(kind, "hit")] >= 5 and tally[(kind, "fwd=miss")] >= 5, tally
    assert tally[("rest", "fwd=bypass")] > 0 and tally[("rest", "fwd=request")] > 0, tally
