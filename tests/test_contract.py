"""The Python contract against the filter's Rust source: limits, defaults, field and header names.

filter/core/src/config.rs (and the header constants elsewhere in the core and the Wasm host) are parsed (constants,
string literals), so a value changed on one side only fails here instead of at runtime in Envoy."""

from __future__ import annotations

import re
import typing

import pytest

from meshcache.contract import filter_config as fc
from meshcache.contract import grpc_hit, headers
from meshcache.contract.paths import REPO_ROOT

CONFIG_RS = (REPO_ROOT / "filter" / "core" / "src" / "config.rs").read_text()
FILTER_SOURCES = "\n".join(
    p.read_text() for crate in ("core", "wasm") for p in sorted((REPO_ROOT / "filter" / crate / "src").glob("*.rs"))
)
# Rust constant in config.rs -> the Python name that mirrors it.
MIRRORED = {
    "DEFAULT_MAX_ENTRY_BYTES": "DEFAULT_MAX_ENTRY_BYTES",
    "DEFAULT_MAX_TOTAL_BYTES": "DEFAULT_MAX_TOTAL_BYTES",
    "DEFAULT_MAX_ENTRIES": "DEFAULT_MAX_ENTRIES",
    "LIMIT_MAX_ENTRY_BYTES": "LIMIT_MAX_ENTRY_BYTES",
    "LIMIT_MAX_TOTAL_BYTES": "LIMIT_MAX_TOTAL_BYTES",
    "LIMIT_MAX_ENTRIES": "LIMIT_MAX_ENTRIES",
    "LIMIT_POLICIES": "LIMIT_POLICIES",
    "LIMIT_PREFIX_LEN": "MAX_PREFIX_LEN",
    "LIMIT_IGNORE_FIELDS": "LIMIT_IGNORE_FIELDS",
    "LIMIT_FIELD_LEN": "LIMIT_FIELD_LEN",
    "DEFAULT_COALESCE_TIMEOUT_MS": "DEFAULT_COALESCE_TIMEOUT_MS",
    "LIMIT_COALESCE_TIMEOUT_MS": "LIMIT_COALESCE_TIMEOUT_MS",
    "LIMIT_STALE_S": "LIMIT_STALE_S",
    "DEFAULT_SEMANTIC_TIMEOUT_MS": "DEFAULT_SEMANTIC_TIMEOUT_MS",
    "LIMIT_SEMANTIC_TIMEOUT_MS": "LIMIT_SEMANTIC_TIMEOUT_MS",
}


def rust_int_consts(source: str) -> dict[str, int]:
    """`pub const NAME: u64 = 64 * 1_048_576;` -> {NAME: 67108864} (integer literals and `*` only)."""
    out = {}
    for name, expr in re.findall(r"pub const ([A-Z_]+): (?:u\d+|usize) = ([0-9_ *]+);", source):
        value = 1
        for factor in expr.split("*"):
            value *= int(factor.strip().replace("_", ""))
        out[name] = value
    return out


def rust_str_consts(source: str) -> dict[str, str]:
    return dict(re.findall(r'(?:pub )?const ([A-Z_]+): &str = "([^"]*)";', source))


def test_every_filter_limit_and_default_is_mirrored_exactly() -> None:
    consts = rust_int_consts(CONFIG_RS)
    assert set(consts) == set(MIRRORED), "a constant was added to or removed from config.rs: mirror it"
    for rust_name, py_name in MIRRORED.items():
        assert getattr(fc, py_name) == consts[rust_name], f"{py_name} != config.rs {rust_name}"


def test_the_parser_reads_what_it_should() -> None:
    assert rust_int_consts("pub const A: u64 = 16 * 1_073_741_824;\npub const B: usize = 7;") == {
        "A": 16 * 2**30, "B": 7}


def test_limits_model_uses_the_filter_defaults_and_ceilings() -> None:
    assert fc.Limits().model_dump() == {"max_entry_bytes": fc.DEFAULT_MAX_ENTRY_BYTES,
                                        "max_total_bytes": fc.DEFAULT_MAX_TOTAL_BYTES,
                                        "max_entries": fc.DEFAULT_MAX_ENTRIES}
    fc.Limits(max_entry_bytes=fc.LIMIT_MAX_ENTRY_BYTES, max_total_bytes=fc.LIMIT_MAX_TOTAL_BYTES,
              max_entries=fc.LIMIT_MAX_ENTRIES)
    with pytest.raises(ValueError):
        fc.Limits(max_entries=fc.LIMIT_MAX_ENTRIES + 1)


def test_default_hash_headers_match_the_filter() -> None:
    m = re.search(r'"hash_headers".*?unwrap_or_else\(\|\| vec!\[(.*?)\]\)', CONFIG_RS, re.S)
    assert m, "config.rs no longer spells the hash_headers default as expected: update this test"
    assert tuple(re.findall(r'"([^"]+)"', m.group(1))) == fc.DEFAULT_HASH_HEADERS
    assert fc.Policy(model_prefix="m", ttl_s=1, max_ttl_s=1).hash_headers == fc.DEFAULT_HASH_HEADERS


def test_coalescing_and_stale_defaults_and_bounds_match_the_filter() -> None:
    assert 'unwrap_or(DEFAULT_COALESCE_TIMEOUT_MS)' in CONFIG_RS
    assert re.search(r'"stale_if_error_s".*?unwrap_or\(0\)', CONFIG_RS)
    assert re.search(r'"stale_while_revalidate_s".*?unwrap_or\(0\)', CONFIG_RS)
    p = fc.Policy(model_prefix="m", ttl_s=1, max_ttl_s=1)
    assert (p.coalesce_timeout_ms, p.stale_if_error_s, p.stale_while_revalidate_s) == (
        fc.DEFAULT_COALESCE_TIMEOUT_MS, 0, 0)
    fc.Policy(model_prefix="m", ttl_s=1, max_ttl_s=1, coalesce_timeout_ms=fc.LIMIT_COALESCE_TIMEOUT_MS,
              stale_if_error_s=fc.LIMIT_STALE_S, stale_while_revalidate_s=fc.LIMIT_STALE_S)
    for field, value in (("coalesce_timeout_ms", fc.LIMIT_COALESCE_TIMEOUT_MS + 1), ("coalesce_timeout_ms", -1),
                         ("stale_if_error_s", fc.LIMIT_STALE_S + 1), ("stale_while_revalidate_s", -1)):
        with pytest.raises(ValueError):
            fc.Policy(model_prefix="m", ttl_s=1, max_ttl_s=1, **{field: value})


def test_client_no_cache_values_and_default_match_the_filter() -> None:
    m = re.search(r'"client_no_cache".*?None \| Some\("(\w+)"\) => ClientNoCache::\w+,\s*Some\("(\w+)"\)',
                  CONFIG_RS, re.S)
    assert m, "config.rs no longer spells client_no_cache as expected: update this test"
    assert m.group(1) == fc.DEFAULT_CLIENT_NO_CACHE
    assert {m.group(1), m.group(2)} == set(typing.get_args(fc.ClientNoCache))
    assert fc.Policy(model_prefix="m", ttl_s=1, max_ttl_s=1).client_no_cache == fc.DEFAULT_CLIENT_NO_CACHE
    with pytest.raises(ValueError):
        fc.Policy(model_prefix="m", ttl_s=1, max_ttl_s=1, client_no_cache="bypass")  # type: ignore[arg-type]


def test_header_name_characters_match_the_filter() -> None:
    m = re.search(r'is_ascii_alphanumeric\(\) \|\| b"([^"]+)"\.contains', CONFIG_RS)
    assert m, "config.rs no longer spells the header-name bytes as expected: update this test"
    assert sorted(m.group(1)) == sorted(fc.HEADER_NAME_SYMBOLS)
    allowed = set(re.fullmatch(r"\^\[(.*)\]\+\$", fc.HEADER_PATTERN).group(1))  # type: ignore[union-attr]
    assert set(fc.HEADER_NAME_SYMBOLS) <= allowed


def test_field_names_are_the_ones_the_filter_reads() -> None:
    top = [fc.VERSION, fc.COLOR, fc.HOLD_HEADERS, fc.POLICIES, fc.ROLE, fc.SEMANTIC_SERVICE]
    fields = [*top, *fc.Policy.model_fields, *fc.Limits.model_fields]
    missing = [f for f in fields if f'"{f}"' not in CONFIG_RS]
    assert not missing, f"config.rs does not read {missing}"
    assert f'Some("{fc.ROLE_SERVER}") => Role::Server' in CONFIG_RS
    assert 'Some("cache")' not in CONFIG_RS, "the old spelling of the server role is gone"
    assert f'Some("{fc.ROLE_CLIENT}") => Role::Client' in CONFIG_RS


def test_header_names_match_the_filter() -> None:
    rust = rust_str_consts(FILTER_SOURCES)
    assert rust["COLOR_HEADER"] == headers.COLOR_HEADER
    assert rust["HASH_HEADER"] == headers.HASH_HEADER
    assert rust["CACHE_STATUS"] == headers.CACHE_STATUS_HEADER
    assert rust["MODEL_HEADER"] == headers.MODEL_ID_HEADER
    assert rust["MODEL_VERSION_HEADER"] == headers.MODEL_VERSION_HEADER
    assert rust["ROUTE_KEY_HEADER"] == headers.ROUTE_KEY_HEADER
    assert rust["UPSTREAM_CLUSTER_HEADER"] == headers.UPSTREAM_CLUSTER_HEADER
    assert rust["CACHE_STATUS_COLLAPSED"] == headers.CACHE_STATUS_COLLAPSED
    assert headers.MODEL_ID_HEADER in fc.DEFAULT_HASH_HEADERS


def test_grpc_hit_marker_matches_the_filter() -> None:
    # The filter's proxy_set_property("meshcache_local") is Envoy filter state `wasm.meshcache_local`,
    # which the hit route matches (meshcache.contract.grpc_hit).
    assert grpc_hit.LOCAL_MARKER_FILTER_STATE == "wasm." + rust_str_consts(FILTER_SOURCES)["LOCAL_MARKER"]
    assert grpc_hit.STALE_MARKER_FILTER_STATE == "wasm." + rust_str_consts(FILTER_SOURCES)["STALE_MARKER"]


def test_plugin_config_is_canonical() -> None:
    a = fc.plugin_config("3", reversed(fc.demo_policies(generation=2)))
    b = fc.plugin_config("3", fc.demo_policies(generation=2), fc.Limits())
    assert fc.plugin_config_json(a) == fc.plugin_config_json(b)
    assert [p["model_prefix"] for p in a["policies"]] == sorted(fc.DEMO_POLICIES)
    assert a["version"] == "3" and a["color"] == "" and a["max_entries"] == fc.DEFAULT_MAX_ENTRIES
