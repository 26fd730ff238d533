"""Typed request and response bodies, and the validated policy/limits rows of a snapshot.

The bounds mirror (or are stricter than) what the filter accepts in on_configure
(filter/src/config.rs), so anything the API accepts renders to a config the filter loads.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator

DEFAULT_HASH_HEADERS: tuple[str, ...] = ("content-type", "x-model-id")
DEFAULT_MAX_ENTRY_BYTES = 1_048_576
DEFAULT_MAX_TOTAL_BYTES = 67_108_864
DEFAULT_MAX_ENTRIES = 16_384
LIMIT_MAX_ENTRY_BYTES = 64 * 1_048_576
LIMIT_MAX_TOTAL_BYTES = 16 * 1_073_741_824
LIMIT_MAX_ENTRIES = 1_048_576
MAX_TTL_S = 30 * 24 * 3600
MAX_PREFIX_LEN = 256
MAX_HEADERS = 32
# Model names as they appear in KServe v2 paths and x-model-id: no slashes, no spaces.
PREFIX_PATTERN = r"^[A-Za-z0-9._:@+-]+$"
# RFC 9110 token characters, lowercase only (HTTP/2 header names are lowercase).
HEADER_PATTERN = r"^[a-z0-9!#$%&'*+.^_`|~-]+$"

ModelPrefix = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_PREFIX_LEN, pattern=PREFIX_PATTERN)
]
HeaderName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=HEADER_PATTERN)]
Scope = Literal["shared", "principal"]
TtlSeconds = Annotated[int, Field(ge=0, le=MAX_TTL_S)]


def _no_duplicates(values: list[str]) -> list[str]:
    if len(set(values)) != len(values):
        raise ValueError("header names must not repeat")
    return values


class PolicySpec(BaseModel):
    """Body of PUT /v1/policies/{model_prefix}. `generation` is managed by the server (purge)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_prefix: ModelPrefix | None = Field(
        None, description="Optional; must equal the path's model_prefix when given"
    )
    ttl_s: TtlSeconds = Field(description="Seconds a stored response is served")
    max_ttl_s: TtlSeconds | None = Field(None, description="Upper bound for per-response TTLs; default ttl_s")
    hash_headers: list[HeaderName] = Field(
        default_factory=lambda: list(DEFAULT_HASH_HEADERS), max_length=MAX_HEADERS
    )
    vary_headers: list[HeaderName] = Field(default_factory=list, max_length=MAX_HEADERS)
    scope: Scope = "shared"
    enabled: bool = True

    @field_validator("max_ttl_s")
    @classmethod
    def _max_at_least_ttl(cls, v: int | None, info: ValidationInfo) -> int | None:
        ttl = info.data.get("ttl_s")
        if v is not None and ttl is not None and v < ttl:
            raise ValueError(f"must be at least ttl_s ({ttl})")
        return v

    _hash_unique = field_validator("hash_headers")(_no_duplicates)
    _vary_unique = field_validator("vary_headers")(_no_duplicates)


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

    @classmethod
    def from_spec(cls, model_prefix: str, spec: PolicySpec, generation: int) -> Policy:
        return cls(
            model_prefix=model_prefix,
            ttl_s=spec.ttl_s,
            max_ttl_s=spec.max_ttl_s if spec.max_ttl_s is not None else spec.ttl_s,
            generation=generation,
            hash_headers=tuple(spec.hash_headers),
            vary_headers=tuple(spec.vary_headers),
            scope=spec.scope,
            enabled=spec.enabled,
        )


class Limits(BaseModel):
    """Global cache limits (also the body of PUT /v1/limits)."""

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


class PurgeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model_prefix: ModelPrefix


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: int = Field(ge=1, le=2**53)


class PoliciesOut(BaseModel):
    version: int
    policies: list[Policy]


class PolicyOut(BaseModel):
    version: int
    policy: Policy


class WriteResult(BaseModel):
    version: int = Field(description="The current snapshot version after the write")
    changed: bool = Field(description="False when the write equalled the current state")
    policy: Policy | None = None


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
    connected_since: float
    acked_version: str
    acked_at: float | None
    current: bool
    last_nack: NackOut | None


class ProxiesOut(BaseModel):
    version: int
    proxies: list[ProxyOut]


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
