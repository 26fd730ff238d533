"""The filter's plugin configuration (parsed by filter/core/src/config.rs), defined once in Python.

Field names are those of `Policy` and `Limits` plus the top-level `version`, `color`,
`hold_headers` and `policies`. The defaults and limits below are the filter's own constants;
tests/test_contract.py parses them out of config.rs, so the two cannot drift. The control plane's
API validates with these bounds (or stricter ones), so anything it accepts the filter loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# ---- the filter's constants (filter/core/src/config.rs) -----------------------------------------
DEFAULT_MAX_ENTRY_BYTES = 1_048_576
DEFAULT_MAX_TOTAL_BYTES = 67_108_864
DEFAULT_MAX_ENTRIES = 16_384
LIMIT_MAX_ENTRY_BYTES = 64 * 1_048_576
LIMIT_MAX_TOTAL_BYTES = 16 * 1_073_741_824
LIMIT_MAX_ENTRIES = 1_048_576
LIMIT_POLICIES = 4096
MAX_PREFIX_LEN = 256  # LIMIT_PREFIX_LEN in config.rs
LIMIT_IGNORE_FIELDS = 64  # `ignore_fields` names per policy
LIMIT_FIELD_LEN = 256  # bytes per `ignore_fields` name
DEFAULT_COALESCE_TIMEOUT_MS = 5000  # identical misses wait this long for the first one's answer
LIMIT_COALESCE_TIMEOUT_MS = 60_000
LIMIT_STALE_S = 86_400  # bound of stale_if_error_s and stale_while_revalidate_s
DEFAULT_HASH_HEADERS: tuple[str, ...] = ("content-type", "x-model-id")
HEADER_NAME_SYMBOLS = "!#$%&'*+-.^_`|~"  # RFC 9110 token characters besides letters and digits

# ---- stricter bounds the control plane applies (the filter would accept more) ---------------
MAX_TTL_S = 30 * 24 * 3600
MAX_HEADERS = 32
MAX_HEADER_NAME_LEN = 128
# Model names as they appear in KServe v2 paths and x-model-id: no slashes, no spaces.
PREFIX_PATTERN = r"^[A-Za-z0-9._:@+-]+$"
# RFC 9110 token characters, lowercase only (HTTP/2 header names are lowercase).
HEADER_PATTERN = r"^[a-z0-9!#$%&'*+.^_`|~-]+$"

# ---- top-level field names ------------------------------------------------------------------
VERSION = "version"
COLOR = "color"
HOLD_HEADERS = "hold_headers"
POLICIES = "policies"
ROLE = "role"  # optional: "server" (default) or "client"
ROLE_SERVER = "server"
ROLE_CLIENT = "client"  # the caller's sidecar: only sets the routing key (headers.ROUTE_KEY_HEADER)
SEMANTIC_SERVICE = "semantic_service"  # optional: where the filter looks up semantic hits (absent: off)

Scope = Literal["shared", "principal"]
# What a client's `Cache-Control: no-cache` / `max-age=0` does (docs/filter.md): revalidate (go
# upstream and refresh the entry, `fwd=request`) or ignore (look up as usual).
ClientNoCache = Literal["revalidate", "ignore"]
DEFAULT_CLIENT_NO_CACHE: ClientNoCache = "revalidate"
CoalesceTimeoutMs = Annotated[int, Field(ge=0, le=LIMIT_COALESCE_TIMEOUT_MS)]
StaleSeconds = Annotated[int, Field(ge=0, le=LIMIT_STALE_S)]
# meshcache.semantic.DEFAULT_THRESHOLD (the contract imports nothing of the project; a test
# checks the two are equal): the lowest threshold with no wrong match on the shipped pairs.
DEFAULT_SEMANTIC_THRESHOLD = 0.999
DEFAULT_SEMANTIC_TIMEOUT_MS = 200
LIMIT_SEMANTIC_TIMEOUT_MS = 5000
# An Envoy cluster name (any printable text) and an HTTP authority (host[:port], no path).
SEMANTIC_CLUSTER_PATTERN = r"^[A-Za-z0-9_.:|-]+$"
AUTHORITY_PATTERN = r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?$"


class SemanticPolicy(BaseModel):
    """A policy's opt-in semantic layer (docs/llm.md): on an exact miss, a stored answer whose
    prompt differs only in the last user message, by embedding similarity >= threshold. shadow:
    look up and record what would have been served, but always go upstream."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    threshold: float = Field(DEFAULT_SEMANTIC_THRESHOLD, gt=0.0, le=1.0)
    shadow: bool = False


class SemanticService(BaseModel):
    """Top-level `semantic_service`: the index service the filter calls (an Envoy cluster of the
    sidecar, the Host it is called with, the call's timeout). Absent: no semantic lookups."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    cluster: str = Field(min_length=1, max_length=256, pattern=SEMANTIC_CLUSTER_PATTERN)
    authority: str = Field(min_length=1, max_length=261, pattern=AUTHORITY_PATTERN)
    timeout_ms: int = Field(DEFAULT_SEMANTIC_TIMEOUT_MS, ge=1, le=LIMIT_SEMANTIC_TIMEOUT_MS)


class Policy(BaseModel):
    """One row of the filter's `policies` (exactly the filter's field names)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_prefix: str
    ttl_s: int
    max_ttl_s: int
    generation: int = 0
    hash_headers: tuple[str, ...] = DEFAULT_HASH_HEADERS
    vary_headers: tuple[str, ...] = ()
    scope: Scope = "shared"
    enabled: bool = True
    # Top-level JSON body fields left out of the key (e.g. OpenAI's `user`, `metadata`).
    ignore_fields: tuple[str, ...] = ()
    # OpenAI chat/completions: requests whose answer is a sample (temperature > 0 or absent,
    # no seed) bypass the cache.
    deterministic_only: bool = False
    # Request coalescing: identical misses wait up to this long for the first one's answer, then
    # go upstream themselves (0 = off).
    coalesce_timeout_ms: CoalesceTimeoutMs = DEFAULT_COALESCE_TIMEOUT_MS
    # RFC 5861: an expired entry may answer for this long past its TTL when upstream fails (0 = off).
    stale_if_error_s: StaleSeconds = 0
    # RFC 5861: an expired entry answers at once for this long while one request refreshes it (0 = off).
    stale_while_revalidate_s: StaleSeconds = 0
    # A client's Cache-Control no-cache / max-age=0: revalidate (upstream, refreshes the entry) or ignore.
    client_no_cache: ClientNoCache = DEFAULT_CLIENT_NO_CACHE
    # The opt-in semantic layer (None: off). Left out of the plugin configuration when off, so a
    # policy without it renders exactly as before.
    semantic: SemanticPolicy | None = None

    def filter_row(self) -> dict[str, Any]:
        """This policy as a row of the plugin configuration's `policies`."""
        row = self.model_dump(mode="json")
        if row["semantic"] is None:
            del row["semantic"]
        return row


# What each policy field does, in one place: the API's OpenAPI descriptions and the CLI's help.
POLICY_FIELD_HELP: dict[str, str] = {
    "model_prefix": "Models whose name starts with this prefix (the longest matching prefix wins)",
    "ttl_s": "Seconds an answer is served when the engine gives no freshness (Cache-Control max-age, "
             "Expires); lowering it also shortens entries already stored that got this TTL",
    "max_ttl_s": "Upper bound in seconds for every entry's TTL, the engine's included (default ttl_s); "
                 "lowering it also shortens entries already stored",
    "generation": "Managed by the control plane: a purge gives the policy a new generation (new keys)",
    "hash_headers": "Response headers covered by x-response-hash and the ETag (with the body)",
    "vary_headers": "Request headers whose values split entries (every line, byte for byte)",
    "scope": "shared: one entry for every caller; principal: entries keyed on the calling workload's "
             "identity (the peer's SPIFFE id from mTLS, e.g. spiffe://cluster.local/ns/app/sa/web), not on "
             "the end user; requests without a peer identity bypass",
    "enabled": "false keeps the policy but bypasses the cache for its models (entries are not served)",
    "ignore_fields": "Top-level JSON body fields left out of the cache key (e.g. OpenAI's user, metadata)",
    "deterministic_only": "OpenAI chat/completions: bypass requests whose answer is a sample "
                          "(temperature > 0 or absent, without an integer seed)",
    "coalesce_timeout_ms": "Identical misses wait up to this many ms for the first one's answer, then go "
                           "upstream themselves; 0 = off",
    "stale_if_error_s": "RFC 5861: serve an expired entry up to this many s past its TTL when the engine "
                        "fails; 0 = off",
    "stale_while_revalidate_s": "RFC 5861: serve an expired entry at once for this many s while one request "
                                "refreshes it; 0 = off",
    "client_no_cache": "A client's Cache-Control: no-cache or max-age=0. revalidate (default): the request "
                       "goes to the engine and its answer refreshes the entry (Cache-Status fwd=request); "
                       "ignore: looked up like any other request",
    "semantic": "Opt-in semantic layer (LLM chat; docs/llm.md), null = off: {threshold (0 < t <= 1, default "
                f"{DEFAULT_SEMANTIC_THRESHOLD}), shadow (default false)}}. On an exact miss, an answer whose prompt "
                "differs only in the last user message is served when its embedding similarity is >= threshold; "
                "shadow: only recorded (GET /v1/semantic/stats on the service), the request still goes upstream",
}


def policy_spec(row: dict[str, Any]) -> dict[str, Any]:
    """The API body (PUT /v1/policies/{prefix}) that recreates a policy row as the API lists it:
    every field but the path's `model_prefix` and the server-managed `generation`."""
    return {k: v for k, v in row.items() if k in Policy.model_fields and k not in ("model_prefix", "generation")}


class Limits(BaseModel):
    """Global cache limits (top-level fields of the plugin configuration)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    max_entry_bytes: int = Field(DEFAULT_MAX_ENTRY_BYTES, ge=1, le=LIMIT_MAX_ENTRY_BYTES)
    max_total_bytes: int = Field(DEFAULT_MAX_TOTAL_BYTES, ge=1, le=LIMIT_MAX_TOTAL_BYTES)
    max_entries: int = Field(DEFAULT_MAX_ENTRIES, ge=1, le=LIMIT_MAX_ENTRIES)

    @field_validator("max_total_bytes")
    @classmethod
    def _total_holds_one_entry(cls, v: int, info: ValidationInfo) -> int:
        entry = info.data.get("max_entry_bytes")
        if entry is not None and v < entry:
            raise ValueError(f"must be at least max_entry_bytes ({entry})")
        return v


TtlSeconds = Annotated[int, Field(ge=0, le=MAX_TTL_S)]


def plugin_config(version: str, policies: Iterable[Policy], limits: Limits | None = None,
                  color: str = "", semantic_service: SemanticService | None = None) -> dict[str, Any]:
    """The plugin configuration for these policies (sorted by prefix: equal contents, equal bytes)."""
    config: dict[str, Any] = {
        VERSION: version,
        COLOR: color,
        **(limits if limits is not None else Limits()).model_dump(),
        POLICIES: [p.filter_row() for p in sorted(policies, key=lambda p: p.model_prefix)],
    }
    if semantic_service is not None:
        config[SEMANTIC_SERVICE] = semantic_service.model_dump()
    return config


def client_plugin_config(config: dict[str, Any]) -> dict[str, Any]:
    """The client role's configuration for a server configuration: the same policies (so it
    keys, and bypasses, exactly as the server would), role client, headers held (the key needs
    the body before the router picks a replica)."""
    return {**config, ROLE: ROLE_CLIENT, HOLD_HEADERS: True}


def plugin_config_json(config: dict[str, Any]) -> str:
    """Canonical JSON text of a plugin configuration (sorted keys: equal configs, equal bytes)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


# The demo models' policies (engine's demo repository): seeded by `meshcache up`, in the
# reference Envoy configs and in the committed Istio base. Seeding order sets the generations.
DEMO_POLICIES: dict[str, dict[str, int]] = {
    "resnet-mini": {"ttl_s": 300, "max_ttl_s": 1800},
    "mlp-classifier": {"ttl_s": 300, "max_ttl_s": 1800},
    "text-embedder": {"ttl_s": 600, "max_ttl_s": 3600},
}


# The LLM demo models' policies (`meshcache demo --llm`, `init-models --llm`): the TTL table's
# llama3/gemma2 prefixes (the engine serves llama3-tiny also as llama3-70b-demo and
# gemma2-27b-demo). Only deterministic requests (temperature 0, or an integer seed) are cached;
# `user` and `metadata` do not shape the answer.
# Both turn the semantic layer on at the shipped threshold (a mesh with the semantic index
# service: `meshcache demo --llm`; elsewhere the filter has no `semantic_service` and ignores it).
_LLM_DEMO_POLICY: dict[str, Any] = {
    "ttl_s": 600, "max_ttl_s": 3600, "deterministic_only": True, "ignore_fields": ["user", "metadata"],
    "semantic": {"threshold": DEFAULT_SEMANTIC_THRESHOLD, "shadow": False},
}
LLM_DEMO_POLICIES: dict[str, dict[str, Any]] = {p: dict(_LLM_DEMO_POLICY) for p in ("llama3-", "gemma2-")}


def demo_policies(generation: int = 0) -> list[Policy]:
    return [Policy(model_prefix=prefix, generation=generation, **spec) for prefix, spec in DEMO_POLICIES.items()]
