"""Cache safety in a real Envoy: no answer reaches a client it was not computed for (repeated
keyed headers, upstream Vary, credentials, model-source conflicts, header bytes, freshness)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.filter.stack import config, filter_stack, policy

INFER = "/v2/models/m/infer"
BODY = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}'
STORED = "meshcache; fwd=miss; stored"
BYPASS = "meshcache; fwd=bypass; detail="


def _body(tag: str) -> bytes:
    """A distinct KServe v2 JSON request (the filter keys KServe REST bodies as JSON)."""
    return b'{"parameters": {"tag": "%s"}, "inputs": []}' % tag.encode()


def _post(c: httpx.Client, url: str, headers: list[tuple[str, str | bytes]] | None = None,
          body: bytes = BODY) -> httpx.Response:
    r = c.post(url, content=body, headers=headers or [])
    assert r.status_code == 200, r.text
    return r


def test_repeated_keyed_headers_are_never_shared(tmp_path: Path, host: str) -> None:
    cfg = config(policy("m", vary_headers=["x-tenant"]), color="green")
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client(timeout=10) as c:
        url = s.url(INFER)
        # Entries for the plain colours exist...
        assert _post(c, url, [("x-traffic-color", "blue")]).headers["cache-status"] == STORED
        assert _post(c, url, [("x-traffic-color", "green")]).headers["cache-status"] == STORED
        # ...and a request with two colours gets neither of them, nor stores under one.
        for twice in ([("x-traffic-color", ""), ("x-traffic-color", "blue")],
                      [("x-traffic-color", "green"), ("x-traffic-color", "blue")],
                      [("x-model-id", "m"), ("x-model-id", "m")]):
            for _ in range(2):
                r = _post(c, url, list(twice))
                assert r.headers["cache-status"] == BYPASS + "repeated-header", twice
        # Vary headers are keyed on every line: one tenant line is not two.
        assert _post(c, url, [("x-tenant", "a")]).headers["cache-status"] == STORED
        r = _post(c, url, [("x-tenant", "a"), ("x-tenant", "b")])
        assert r.headers["cache-status"] == STORED, "a different key, not the tenant-a entry"
        again = _post(c, url, [("x-tenant", "a"), ("x-tenant", "b")])
        assert again.headers["cache-status"].startswith("meshcache; hit")
        assert s.origin_calls()["http"] == 2 + 3 * 2 + 2


def test_upstream_vary(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy("m", vary_headers=["x-tenant"])), host=host) as s, \
            httpx.Client(timeout=10) as c:
        url = s.url(INFER)
        cases = [("x-user", "meshcache; fwd=miss; detail=vary"), ("*", "meshcache; fwd=miss; detail=vary"),
                 ("Accept-Encoding", "meshcache; fwd=miss; detail=vary")]
        for vary, status in cases:
            alice = _post(c, url, [("x-user", "alice"), ("x-origin-header", f"Vary: {vary}")], body=_body(vary))
            assert alice.headers["cache-status"] == status, vary
            bob = _post(c, url, [("x-user", "bob"), ("x-origin-header", f"Vary: {vary}")], body=_body(vary))
            assert bob.json()["user"] == "bob", f"Vary: {vary} - Alice's answer served to Bob"
        # A Vary the key already covers is stored, and kept apart per tenant.
        keyed = [("x-origin-header", "Vary: X-Tenant")]
        assert _post(c, url, [("x-tenant", "a"), *keyed]).headers["cache-status"] == STORED
        assert _post(c, url, [("x-tenant", "b"), *keyed]).headers["cache-status"] == STORED
        hit = _post(c, url, [("x-tenant", "a"), *keyed])
        assert hit.headers["cache-status"].startswith("meshcache; hit")
        assert hit.headers["vary"] == "X-Tenant"
        # Vary on a model-selecting header is honoured: those headers are keyed by value or
        # absence (docs/filter.md, "Headers that pick the model"); another model bypasses.
        for name in ("x-model-id", "x-model-version"):
            by_model = [("x-origin-header", f"Vary: {name}")]
            assert _post(c, url, by_model, body=_body(name)).headers["cache-status"] == STORED
            value = "m" if name == "x-model-id" else "2"
            assert _post(c, url, [(name, value), *by_model], body=_body(name)).headers["cache-status"] == STORED
            same = _post(c, url, [(name, value), *by_model], body=_body(name))
            assert same.headers["cache-status"].startswith("meshcache; hit"), name
        other = _post(c, url, [("x-model-id", "n"), *by_model], body=_body("vm"))
        assert other.headers["cache-status"] == BYPASS + "model-conflict"


def test_cookies_and_proxy_credentials(tmp_path: Path, host: str) -> None:
    cfg = config(policy("m"))
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client(timeout=10) as c:
        url = s.url(INFER)
        _post(c, url)  # a shared entry exists
        for cred in ("cookie", "proxy-authorization"):
            r = _post(c, url, [(cred, "session=alice")])
            assert r.headers["cache-status"] == BYPASS + "credentials", cred
        # An answer that sets a cookie belongs to one client: passed on, not stored.
        set_cookie = [("x-origin-header", "Set-Cookie: session=alice")]
        c.cookies.clear()
        first = _post(c, url, set_cookie, body=_body("other"))
        c.cookies.clear()  # the client keeps cookies it is sent; this test sends none
        assert first.headers["cache-status"] == "meshcache; fwd=miss; detail=set-cookie"
        assert first.headers["set-cookie"] == "session=alice"
        second = _post(c, url, set_cookie, body=_body("other"))
        assert second.headers["cache-status"] == "meshcache; fwd=miss; detail=set-cookie"
        # RFC 2965's Set-Cookie2 sets state just the same.
        for _ in range(2):
            c.cookies.clear()
            r = _post(c, url, [("x-origin-header", "Set-Cookie2: session=alice; Version=1")], body=_body("c2"))
            assert r.headers["cache-status"] == "meshcache; fwd=miss; detail=set-cookie"
            assert r.headers["set-cookie2"] == "session=alice; Version=1"
        assert s.origin_calls()["http"] == 1 + 2 + 2 + 2


def test_model_sources_that_disagree_bypass(tmp_path: Path, host: str) -> None:
    cfg = config(policy("m"), policy("gpt"))
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client(timeout=10) as c:
        assert _post(c, s.url(INFER)).headers["cache-status"] == STORED
        for _ in range(2):
            r = _post(c, s.url(INFER), [("x-model-id", "secret-model")])
            assert r.headers["cache-status"] == BYPASS + "model-conflict", "path says m, header says otherwise"
        chat = b'{"model": "unpolicied", "messages": []}'
        for _ in range(2):
            r = _post(c, s.url("/v1/chat/completions"), [("x-model-id", "gpt-4")], body=chat)
            assert r.headers["cache-status"] == BYPASS + "model-conflict", "the body names a model without a policy"
        agreeing = b'{"model": "gpt-4", "messages": []}'
        _post(c, s.url("/v1/chat/completions"), [("x-model-id", "gpt-4")], body=agreeing)
        r = _post(c, s.url("/v1/chat/completions"), [("x-model-id", "gpt-4")], body=agreeing)
        assert r.headers["cache-status"].startswith("meshcache; hit")


def test_an_ambiguous_body_model_never_borrows_the_header_s_policy(tmp_path: Path, host: str) -> None:
    """A chat body whose `model` is repeated or not a non-empty string is read by the server its
    own way (Python's json: the last one wins); the filter must not fall back to `x-model-id`
    and put the answer under that model's policy (here a shared one, open to every caller)."""
    cfg = config(policy("shared-m"))
    chat = "/v1/chat/completions"
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client(timeout=10) as c:
        bodies = [b'{"model": "private-p", "model": "shared-m", "messages": []}',
                  b'{"model": "shared-m", "model": "private-p", "messages": []}',
                  b'{"model": "shared-m", "model": "shared-m", "messages": []}',
                  b'{"model": "shared-m", "mod\\u0065l": "private-p"}',
                  b'{"model": 7}', b'{"model": null}', b'{"model": ""}', b'{"model": ["shared-m"]}',
                  b'{"model": {"name": "shared-m"}}', b'{"model": "\\udc00"}']
        for body in bodies:
            for _ in range(2):
                r = _post(c, s.url(chat), [("x-model-id", "shared-m")], body=body)
                assert r.headers["cache-status"] == BYPASS + "ambiguous-model", body
        assert s.origin_calls()["http"] == 2 * len(bodies), "every one reached the origin"
        # A body without `model` is still named by the header; one clear `model` by the body.
        for body in (b'{"messages": [{"model": "private-p"}]}', b'{"model": "shared-m", "messages": []}'):
            assert _post(c, s.url(chat), [("x-model-id", "shared-m")], body=body).headers["cache-status"] == STORED
        assert _post(c, s.url(chat), body=b'{"messages": []}').headers["cache-status"] == BYPASS + "no-model"


def test_inference_paths_spelled_otherwise_bypass(tmp_path: Path, host: str) -> None:
    """`/v1/chat/completions/`, `//v1/...`, other case, percent-encoding: routers may send these
    to the chat API, where `deterministic_only` must apply; the filter does not guess: bypass."""
    cfg = config(policy("m", deterministic_only=True))
    sampled = b'{"model": "m", "temperature": 0.9, "messages": []}'
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client(timeout=10) as c:
        paths = ["/v1/chat/completions/", "//v1/chat/completions", "/V1/Chat/Completions", "/v1/chat/%63ompletions",
                 "/v1//completions", "/v2/models/%6d/infer", "/v2/models/m/infer/"]
        for path in paths:
            for _ in range(2):
                r = _post(c, s.url(path), [("x-model-id", "m")], body=sampled)
                assert r.headers["cache-status"] == BYPASS + "path", path
        assert s.origin_calls()["http"] == 2 * len(paths)
        r = _post(c, s.url("/v1/chat/completions"), [("x-model-id", "m")], body=sampled)
        assert r.headers["cache-status"] == BYPASS + "nondeterministic", "the canonical path"


def test_header_values_are_compared_as_bytes(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy("m", vary_headers=["x-tenant"])), host=host) as s, \
            httpx.Client(timeout=10) as c:
        url = s.url(INFER)
        first = _post(c, url, [("x-tenant", b"caf\xe9")])
        second = _post(c, url, [("x-tenant", b"caf\xea")])
        assert first.headers["cache-status"] == BYPASS + "header-bytes"
        assert second.headers["cache-status"] == BYPASS + "header-bytes", "not served the other tenant's entry"
        # An answer with a header that is not UTF-8 is passed on intact, not stored.
        odd = _post(c, url, [("x-origin-header", b"X-Odd: caf\xe9")], body=_body("odd"))
        assert odd.headers["cache-status"] == "meshcache; fwd=miss; detail=header-bytes"
        assert odd.headers.raw[[k.lower() for k, _ in odd.headers.raw].index(b"x-odd")][1] == b"caf\xe9"
        assert s.origin_calls()["http"] == 3


def test_freshness_and_entry_size(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy("m"), max_entry_bytes=1300), host=host) as s, \
            httpx.Client(timeout=10) as c:
        url = s.url(INFER)
        stale = [("x-origin-header", "Expires: Thu, 01 Jan 1970 00:00:00 GMT")]
        for shaping in (stale, [("x-origin-header", "Expires: 0")], [("x-origin-cache-control", "max-age=abc")]):
            for _ in range(2):
                r = _post(c, url, shaping, body=_body(repr(shaping).replace('"', "'")))
                assert r.headers["cache-status"] == "meshcache; fwd=miss; detail=stale", shaping
        future = [("x-origin-header", "Expires: Fri, 01 Jan 2100 00:00:00 GMT")]
        assert _post(c, url, future, body=_body("future")).headers["cache-status"] == STORED
        # 1,000 body bytes (+ ~230 of entry overhead and headers) fit in 1,300; with another 400
        # bytes of stored headers they do not.
        assert _post(c, url, [("x-origin-size", "1000")], body=_body("a")).headers["cache-status"] == STORED
        big_header = [("x-origin-size", "1000"), ("x-origin-header", "X-Big: " + "h" * 400)]
        r = _post(c, url, big_header, body=_body("b"))
        assert r.headers["cache-status"] == "meshcache; fwd=miss; detail=too-big"
        assert len(r.content) == 1000
