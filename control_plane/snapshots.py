"""Immutable versioned snapshots, the pure changes that derive one from another, and the
in-memory cache that pushes the newest snapshot to watchers (go-control-plane's shape).

Generation rule (so a purge is never undone): a policy's generation is a snapshot version,
assigned when the prefix is created (absent from the current snapshot) or purged, and kept on
every other change, including rollbacks. Versions only grow, so the generation of a prefix only
grows, and entries cached under an older generation are never served again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from meshcache.contract.filter_config import (
    Limits,
    Policy,
    SemanticService,
    plugin_config,
    plugin_config_json,
    policy_spec,
)


class ChangeError(Exception):
    """A change that cannot be applied to the current snapshot (mapped to 4xx by the API)."""

    status = 400


class NotFound(ChangeError):
    status = 404


class TooMany(ChangeError):
    status = 409


class Invalid(ChangeError):
    """The change would make an invalid policy; `errors` are pydantic's, per field."""

    status = 422

    def __init__(self, message: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.errors = errors


@dataclass(frozen=True)
class Snapshot:
    version: int
    policies: tuple[Policy, ...] = ()
    limits: Limits = field(default_factory=Limits)
    created_at: float = 0.0
    author: str = ""
    action: str = ""
    # Deployment, not content: where this control plane's proxies reach the semantic index
    # (Settings.semantic_service). Set by the SnapshotCache on every snapshot it installs; not
    # stored, not compared, but rendered into the plugin configuration.
    semantic_service: SemanticService | None = None

    def __post_init__(self) -> None:
        # Sorted by prefix: equal contents render to identical bytes.
        object.__setattr__(self, "policies", tuple(sorted(self.policies, key=lambda p: p.model_prefix)))
        object.__setattr__(self, "_json", plugin_config_json(self.plugin_config()))

    def plugin_config(self) -> dict[str, Any]:
        """The filter's plugin configuration (see the filter's config.rs for the schema)."""
        return plugin_config(str(self.version), self.policies, self.limits,
                             semantic_service=self.semantic_service)

    @property
    def plugin_config_json(self) -> str:
        return self._json  # type: ignore[attr-defined,no-any-return]

    def policy(self, model_prefix: str) -> Policy | None:
        for p in self.policies:
            if p.model_prefix == model_prefix:
                return p
        return None

    def same_content(self, other: Snapshot) -> bool:
        return self.policies == other.policies and self.limits == other.limits

    def to_record(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "created_at": self.created_at,
                "author": self.author,
                "action": self.action,
                "limits": self.limits.model_dump(),
                "policies": [p.model_dump(mode="json") for p in self.policies],
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_record(cls, text: str | bytes) -> Snapshot:
        d = json.loads(text)
        return cls(
            version=int(d["version"]),
            created_at=float(d.get("created_at", 0.0)),
            author=str(d.get("author", "")),
            action=str(d.get("action", "")),
            limits=Limits.model_validate(d.get("limits", {})),
            policies=tuple(Policy.model_validate(p) for p in d.get("policies", [])),
        )


EMPTY = Snapshot(version=0, action="empty")


# ---- Pure changes: (current snapshot, new version) -> new snapshot content -------------------


def _derive(cur: Snapshot, version: int, author: str, action: str, policies: tuple[Policy, ...],
            limits: Limits | None = None) -> Snapshot:
    return Snapshot(
        version=version, policies=policies, limits=limits if limits is not None else cur.limits,
        created_at=time.time(), author=author, action=action,
    )


def put_policy(cur: Snapshot, version: int, author: str, policy: Policy, max_policies: int,
               action: str = "put") -> Snapshot:
    """Adds or replaces the policy for `policy.model_prefix`. Its `generation` is the server's,
    whatever `policy` carries: kept for an existing prefix, the new version for a new one.
    `action` names the change in the snapshot (`put <prefix>`)."""
    prefix = policy.model_prefix
    old = cur.policy(prefix)
    if old is None and len(cur.policies) >= max_policies:
        raise TooMany(f"policy limit reached ({max_policies}); delete one first")
    new = policy.model_copy(update={"generation": old.generation if old is not None else version})
    rest = tuple(p for p in cur.policies if p.model_prefix != prefix)
    return _derive(cur, version, author, f"{action} {prefix}", (*rest, new))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch: objects merge member by member, `null` removes a member,
    anything else (arrays included) replaces the target."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def patch_policy(cur: Snapshot, version: int, author: str, prefix: str, patch: dict[str, Any],
                 max_policies: int, validate: Callable[[dict[str, Any]], Policy]) -> Snapshot:
    """The policy with `patch` merged into it (a removed field takes its default); a prefix
    without a policy starts from the defaults. `validate` checks the result whole, as a PUT body
    (the API's schema), and builds the policy."""
    old = cur.policy(prefix)
    base = policy_spec(old.model_dump(mode="json")) if old is not None else {}
    try:
        policy = validate(merge_patch(base, patch))
    except ValidationError as exc:
        raise Invalid("the patched policy is invalid", exc.errors()) from exc
    return put_policy(cur, version, author, policy, max_policies, action="patch")


def delete_policy(cur: Snapshot, version: int, author: str, prefix: str) -> Snapshot:
    if cur.policy(prefix) is None:
        raise NotFound(f"no policy for model_prefix {prefix!r}")
    rest = tuple(p for p in cur.policies if p.model_prefix != prefix)
    return _derive(cur, version, author, f"delete {prefix}", rest)


def purge(cur: Snapshot, version: int, author: str, prefix: str) -> Snapshot:
    old = cur.policy(prefix)
    if old is None:
        raise NotFound(f"no policy for model_prefix {prefix!r}")
    bumped = old.model_copy(update={"generation": version})
    rest = tuple(p for p in cur.policies if p.model_prefix != prefix)
    return _derive(cur, version, author, f"purge {prefix}", (*rest, bumped))


def purge_all(cur: Snapshot, version: int, author: str) -> Snapshot:
    """Every policy gets the new version as its generation (one snapshot: the whole cache)."""
    if not cur.policies:
        raise NotFound("no policies to purge")
    bumped = tuple(p.model_copy(update={"generation": version}) for p in cur.policies)
    return _derive(cur, version, author, "purge all", bumped)


def set_limits(cur: Snapshot, version: int, author: str, limits: Limits) -> Snapshot:
    return _derive(cur, version, author, "limits", cur.policies, limits)


def rollback(cur: Snapshot, target: Snapshot, version: int, author: str) -> Snapshot:
    """A new snapshot with target's policies and limits; generations never go backwards."""
    policies = []
    for p in target.policies:
        now = cur.policy(p.model_prefix)
        generation = now.generation if now is not None else version
        policies.append(p.model_copy(update={"generation": generation}))
    return _derive(cur, version, author, f"rollback to {target.version}", tuple(policies), target.limits)


# ---- Per-snapshot memo: what renderers build once per snapshot and share across streams -----

T = TypeVar("T")


class SnapshotMemo(Generic[T]):
    """`build(snapshot)` computed once per snapshot: every xDS stream asks for the same snapshot's
    resources, and only the newest one is ever asked for again, so one entry is enough."""

    def __init__(self, build: Callable[[Snapshot], T]) -> None:
        self._build = build
        self._last: tuple[Snapshot, T] | None = None

    def __call__(self, snapshot: Snapshot) -> T:
        if self._last is not None and self._last[0] is snapshot:
            return self._last[1]
        value = self._build(snapshot)
        self._last = (snapshot, value)
        return value


# ---- The cache: newest snapshot in memory, watchers notified on change ---------------------


class SnapshotCache:
    """Holds the newest snapshot; versions only move forward. Used by the API (reads keep
    working from memory when Redis is down) and by every xDS stream (watchers).

    A cache made without `initial` knows no snapshot (`known` False): nothing may be served
    from it, not even version 0, until one is installed (control_plane/README.md, "Never less
    than the last good snapshot"). `origin` says where the current one came from: `redis` (read
    from or committed to the store) or `disk` (the state file, at start)."""

    def __init__(self, initial: Snapshot | None = EMPTY, semantic_service: SemanticService | None = None) -> None:
        # Every snapshot installed renders with this deployment's semantic service (or none).
        self.semantic_service = semantic_service
        initial = self._deployed(initial) if initial is not None else None
        self._current = initial if initial is not None else EMPTY
        self.known = initial is not None
        self.origin = "redis" if initial is not None else ""
        self._watchers: dict[int, Callable[[Snapshot], None]] = {}
        self._next_id = 0
        self.updated_at = time.time()

    @property
    def current(self) -> Snapshot:
        return self._current

    def set(self, snapshot: Snapshot, origin: str = "redis") -> bool:
        """Install `snapshot` if it is newer, or the first one known."""
        if self.known and snapshot.version <= self._current.version:
            return False
        snapshot = self._deployed(snapshot)
        self._current = snapshot
        self.known = True
        self.origin = origin
        self.updated_at = time.time()
        for notify in list(self._watchers.values()):
            notify(snapshot)
        return True

    def _deployed(self, snapshot: Snapshot) -> Snapshot:
        if snapshot.semantic_service == self.semantic_service:
            return snapshot
        return dataclasses.replace(snapshot, semantic_service=self.semantic_service)

    def watch(self, notify: Callable[[Snapshot], None]) -> int:
        self._next_id += 1
        self._watchers[self._next_id] = notify
        return self._next_id

    def unwatch(self, watch_id: int) -> None:
        self._watchers.pop(watch_id, None)
