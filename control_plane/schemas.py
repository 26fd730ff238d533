"""Typed request and response bodies of the HTTP API.

The policy and limits rows themselves (`Policy`, `Limits`) and every bound are the filter's
contract (meshcache.contract.filter_config), so anything the API accepts renders to a config the
filter loads.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from meshcache.contract.filter_config import (
    DEFAULT_CLIENT_NO_CACHE,
    DEFAULT_COALESCE_TIMEOUT_MS,
    DEFAULT_HASH_HEADERS,
    HEADER_PATTERN,
    LIMIT_FIELD_LEN,
    LIMIT_IGNORE_FIELDS,
    MAX_HEADER_NAME_LEN,
    MAX_HEADERS,
    MAX_PREFIX_LEN,
    POLICY_FIELD_HELP,
    PREFIX_PATTERN,
    ClientNoCache,
    CoalesceTimeoutMs,
    Limits,
    Policy,
    Scope,
    SemanticPolicy,
    StaleSeconds,
    TtlSeconds,
)

ModelPrefix = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_PREFIX_LEN, pattern=PREFIX_PATTERN)
]
HeaderName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_HEADER_NAME_LEN, pattern=HEADER_PATTERN)]
# A top-level JSON field name as the filter matches it (exactly, after JSON unescaping).
FieldName = Annotated[str, StringConstraints(min_length=1, max_length=LIMIT_FIELD_LEN)]


def _no_duplicates(values: list[str]) -> list[str]:
    if len(set(values)) != len(values):
        raise ValueError("header names must not repeat")
    return values


H = POLICY_FIELD_HELP


class PolicySpec(BaseModel):
    """Body of PUT /v1/policies/{model_prefix}: the whole policy (fields not given take their
    defaults). `generation` is managed by the server (purge)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_prefix: ModelPrefix | None = Field(
        None, description="Optional; must equal the path's model_prefix when given"
    )
    ttl_s: TtlSeconds = Field(description=H["ttl_s"])
    max_ttl_s: TtlSeconds | None = Field(None, description=H["max_ttl_s"])
    hash_headers: list[HeaderName] = Field(
        default_factory=lambda: list(DEFAULT_HASH_HEADERS), max_length=MAX_HEADERS, description=H["hash_headers"]
    )
    vary_headers: list[HeaderName] = Field(default_factory=list, max_length=MAX_HEADERS,
                                           description=H["vary_headers"])
    scope: Scope = Field("shared", description=H["scope"])
    enabled: bool = Field(True, description=H["enabled"])
    ignore_fields: list[FieldName] = Field(default_factory=list, max_length=LIMIT_IGNORE_FIELDS,
                                           description=H["ignore_fields"])
    deterministic_only: bool = Field(False, description=H["deterministic_only"])
    coalesce_timeout_ms: CoalesceTimeoutMs = Field(DEFAULT_COALESCE_TIMEOUT_MS, description=H["coalesce_timeout_ms"])
    stale_if_error_s: StaleSeconds = Field(0, description=H["stale_if_error_s"])
    stale_while_revalidate_s: StaleSeconds = Field(0, description=H["stale_while_revalidate_s"])
    client_no_cache: ClientNoCache = Field(DEFAULT_CLIENT_NO_CACHE, description=H["client_no_cache"])
    semantic: SemanticPolicy | None = Field(None, description=H["semantic"])

    @field_validator("max_ttl_s")
    @classmethod
    def _max_at_least_ttl(cls, v: int | None, info: ValidationInfo) -> int | None:
        ttl = info.data.get("ttl_s")
        if v is not None and ttl is not None and v < ttl:
            raise ValueError(f"must be at least ttl_s ({ttl})")
        return v

    _hash_unique = field_validator("hash_headers")(_no_duplicates)
    _vary_unique = field_validator("vary_headers")(_no_duplicates)

    @field_validator("ignore_fields")
    @classmethod
    def _fields_fit_the_filter(cls, values: list[str]) -> list[str]:
        if len(set(values)) != len(values):
            raise ValueError("field names must not repeat")
        for name in values:
            if len(name.encode()) > LIMIT_FIELD_LEN:  # the filter counts bytes
                raise ValueError(f"field names are at most {LIMIT_FIELD_LEN} bytes (UTF-8)")
        return values

    def policy(self, model_prefix: str, generation: int) -> Policy:
        """The filter's row for this spec (`max_ttl_s` defaults to `ttl_s`)."""
        return Policy(
            model_prefix=model_prefix,
            ttl_s=self.ttl_s,
            max_ttl_s=self.max_ttl_s if self.max_ttl_s is not None else self.ttl_s,
            generation=generation,
            hash_headers=tuple(self.hash_headers),
            vary_headers=tuple(self.vary_headers),
            scope=self.scope,
            enabled=self.enabled,
            ignore_fields=tuple(self.ignore_fields),
            deterministic_only=self.deterministic_only,
            coalesce_timeout_ms=self.coalesce_timeout_ms,
            stale_if_error_s=self.stale_if_error_s,
            stale_while_revalidate_s=self.stale_while_revalidate_s,
            client_no_cache=self.client_no_cache,
            semantic=self.semantic,
        )


class SemanticPatch(BaseModel):
    """`semantic` in a merge patch: the members to change (null resets one to its default)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    threshold: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    shadow: bool | None = None


class PolicyPatch(BaseModel):
    """Body of PATCH /v1/policies/{model_prefix}: a JSON merge patch (RFC 7396). Only the fields
    it names change; `null` resets a field to its default (`ttl_s` has none: it cannot be
    removed). On a prefix without a policy it creates one from the defaults (`ttl_s` required).
    The types are checked here; the whole patched policy is then validated as a PUT body."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_prefix: ModelPrefix | None = Field(None, description="Optional; must equal the path's model_prefix")
    ttl_s: TtlSeconds | None = Field(None, description=H["ttl_s"])
    max_ttl_s: TtlSeconds | None = Field(None, description=H["max_ttl_s"])
    hash_headers: list[HeaderName] | None = Field(None, max_length=MAX_HEADERS, description=H["hash_headers"])
    vary_headers: list[HeaderName] | None = Field(None, max_length=MAX_HEADERS, description=H["vary_headers"])
    scope: Scope | None = Field(None, description=H["scope"])
    enabled: bool | None = Field(None, description=H["enabled"])
    ignore_fields: list[FieldName] | None = Field(None, max_length=LIMIT_IGNORE_FIELDS,
                                                  description=H["ignore_fields"])
    deterministic_only: bool | None = Field(None, description=H["deterministic_only"])
    coalesce_timeout_ms: CoalesceTimeoutMs | None = Field(None, description=H["coalesce_timeout_ms"])
    stale_if_error_s: StaleSeconds | None = Field(None, description=H["stale_if_error_s"])
    stale_while_revalidate_s: StaleSeconds | None = Field(None, description=H["stale_while_revalidate_s"])
    client_no_cache: ClientNoCache | None = Field(None, description=H["client_no_cache"])
    # A merge patch merges into the object: {"semantic": {"shadow": false}} keeps the threshold.
    semantic: SemanticPatch | None = Field(None, description=H["semantic"])


class PurgeRequest(BaseModel):
    """One model's entries (`model_prefix`) or every policy's (`all`: true), not both."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # `all` first: model_prefix's check reads it.
    all: bool = Field(False, description="Purge every policy (one snapshot): the whole cache stops being served")
    model_prefix: ModelPrefix | None = Field(None, validate_default=True,
                                             description="The policy to purge; required unless all is true")

    @field_validator("model_prefix")
    @classmethod
    def _one_target(cls, v: str | None, info: ValidationInfo) -> str | None:
        every = info.data.get("all", False)
        if v is None and not every:
            raise ValueError("is required (or all: true to purge every policy)")
        if v is not None and every:
            raise ValueError("not with all: true (one or the other)")
        return v


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: int = Field(ge=1, le=2**53)


class PoliciesOut(BaseModel):
    version: int
    policies: list[Policy]


class PolicyOut(BaseModel):
    version: int
    policy: Policy


class HistoryChange(BaseModel):
    what: str = Field(description="added, removed, changed, purged or limits")
    model_prefix: str | None
    fields: dict[str, list[object]] = Field(description="field: [before, after]")


class CacheEffect(BaseModel):
    what: str = Field(description="emptied (every entry lost), evicted (entries dropped down to a smaller "
                                  "budget), shrunk (fewer answers stored from now on), purged or removed "
                                  "(that policy's entries no longer served)")
    model_prefix: str | None = Field(description="The policy concerned; null: the whole cache")
    message: str


class WriteResult(BaseModel):
    version: int = Field(description="The current snapshot version after the write")
    changed: bool = Field(description="False when the write equalled the current state")
    policy: Policy | None = None
    changes: list[HistoryChange] = Field(
        default_factory=list, description="What this write changed (the status page's diff; empty if nothing)")
    warnings: list[str] = Field(
        default_factory=list, description="Applied anyway, but probably not what was meant (e.g. a model_prefix "
                                          "no engine serves a model for), and what the change does to entries "
                                          "already cached (the messages of cache_effects)")
    cache_effects: list[CacheEffect] = Field(
        default_factory=list, description="Entries this change empties, evicts or stops serving on every proxy "
                                          "(empty: it loses nothing already cached)")
    dry_run: bool = Field(False, description="True: nothing was written; `version` is the current one, the one "
                                             "to send as If-Match to apply exactly this change")


class SnapshotOut(BaseModel):
    version: int
    created_at: float
    author: str
    action: str
    limits: Limits
    policies: list[Policy]
    plugin_config: str = Field(description="The filter's plugin configuration exactly as pushed to Envoy")


class NackOut(BaseModel):
    version: str
    error: str
    at: float


class ProxyOut(BaseModel):
    node_id: str
    cluster: str
    stream_id: int
    transport: str
    type_urls: list[str]
    resources: list[str] = Field(description="the resource names it asked for: ECDS "
                                 "`meshcache` (Wasm filter), `meshcache-native` (native host), `meshcache-client`")
    connected_since: float
    acked_version: str
    acked_at: float | None
    current: bool
    last_nack: NackOut | None
    replica: str = Field(description="the control-plane replica holding this proxy's stream (`istiod URL`: "
                         "a sidecar read from istiod's syncz)")
    role: str = Field("proxy", description="`proxy` (an Envoy), `config-client` (istiod, over MCP)")


class ProxiesOut(BaseModel):
    version: int
    replica: str = Field(description="the replica that answered")
    complete: bool = Field(description="false: the other replicas' proxies could not be read (Redis down), "
                           "or istiod's syncz (see istiod_error)")
    proxies: list[ProxyOut] = Field(description="Envoys: connected here, or (transport `istiod`) configured by "
                                    "istiod, as its /debug/syncz reports them")
    config_clients: list[ProxyOut] = Field(default_factory=list,
                                           description="istiod instances reading this control plane over MCP")
    istiod_error: str | None = Field(None, description="why istiod's syncz could not be read (--istiod-debug)")


class FieldError(BaseModel):
    field: str
    reason: str


class ErrorOut(BaseModel):
    detail: str
    errors: list[FieldError] = []


class AuditEntry(BaseModel):
    id: str
    version: int
    actor: str
    action: str
    detail: str
    at: float


class AuditOut(BaseModel):
    entries: list[AuditEntry]


# ---- status page: who am I, cache counters, snapshot history --------------------------------


class WhoAmI(BaseModel):
    name: str
    role: str


class ModelStats(BaseModel):
    model_prefix: str
    in_policy: bool = Field(description="False: counters of a prefix no longer in the current snapshot")
    hits: int
    misses: int
    hit_ratio: float | None = Field(description="hits / (hits + misses); null before any lookup")
    entries: int | None = Field(None, description="Entries of this policy in the readable proxies' caches; null if "
                                "no proxy was read or one's filter does not report entries per policy")
    bytes: int | None = Field(None, description="Bytes of this policy's entries (same rule as entries)")
    tokens_saved_prompt: int | None = Field(None, description="Prompt tokens of the LLM answers served from the "
                                            "cache (their stored `usage`); null if no proxy read counts tokens")
    tokens_saved_completion: int | None = Field(None, description="Completion tokens of the LLM answers served "
                                                "from the cache (same rule)")
    ambiguous_with: list[str] = Field(description="Other prefixes whose stat names are identical")


class ProxyStats(BaseModel):
    node_id: str
    source: str | None = Field(description="Where this proxy's stats were read from")
    ok: bool
    error: str | None = Field(description="Why the stats could not be read")
    read_at: float
    hits: int | None = None
    misses: int | None = None
    bypasses: int | None = None
    stores: int | None = None
    evictions: int | None = None
    errors: int | None = None
    entries: int | None = Field(None, description="Entries in this proxy's cache (all models)")
    bytes: int | None = Field(None, description="Bytes in this proxy's cache (all models)")


class ServingOut(BaseModel):
    """What this control-plane replica serves, and whether its policy store is reachable."""

    source: Literal["redis", "memory", "disk", "none"] = Field(
        description="redis: in step with the store; memory: store unreachable, the snapshot last read from it; "
                    "disk: store not reached since start, the state file's snapshot; none: nothing is served")
    version: int | None = Field(description="The snapshot served over xDS/MCP; null when none is known")
    degraded: bool = Field(description="True while the store is unreachable: writes answer 503")
    store_reachable: bool
    detail: str


class ReadyOut(BaseModel):
    status: Literal["ready", "degraded"]
    version: int
    serving: ServingOut


class SemanticStats(BaseModel):
    """The filter's semantic-layer counters, summed over the proxies read (docs/llm.md)."""

    lookups: int = Field(description="Semantic lookups made on exact misses")
    hits: int = Field(description="Answered from the cache by similarity (Cache-Status detail=semantic)")
    would_hit: int = Field(description="Shadow mode: a stored answer was similar enough, but the request went "
                                       "upstream")
    errors: int = Field(description="Lookups that failed or timed out (the request went upstream)")


class StatsOut(BaseModel):
    version: int
    serving: ServingOut
    read_at: float
    complete: bool = Field(description="False when some proxy's stats could not be read: sums cover the others")
    proxies_read: int
    proxies_unread: int
    models: list[ModelStats]
    unattributed_entries: int | None = Field(None, description="Entries no configured policy claims (a removed "
                                             "policy's, until evicted); models + this = the proxies' entries")
    unattributed_bytes: int | None = Field(None, description="Bytes of the unattributed entries")
    semantic: SemanticStats | None = Field(None, description="The semantic layer's counters; null if no proxy "
                                           "read has them")
    proxies: list[ProxyStats]


class HistoryEntry(BaseModel):
    version: int
    created_at: float
    author: str
    action: str
    policies: int
    diff_known: bool = Field(description="False when the previous snapshot is older than the retention")
    changes: list[HistoryChange]


class HistoryOut(BaseModel):
    version: int
    snapshots: list[HistoryEntry]
