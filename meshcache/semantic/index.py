"""The semantic index: per exact scope, the embeddings of last user messages and the cache keys of
their answers. Bounded (entries per scope and in total; the oldest goes first), entries expire
with their TTL, and purge drops a policy's or a scope's entries.

A lookup compares one unit vector with the scope's vectors only (a dot product = cosine
similarity), so a scope never matches another scope's entries: everything that is not the last
user message is in the scope and must be equal (meshcache.semantic.scope).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

Clock = Callable[[], float]


@dataclass(frozen=True)
class Match:
    key: str
    similarity: float
    response_hash: str
    ttl_left_s: float


@dataclass
class _Scope:
    policy: str
    vectors: np.ndarray  # rows 0..len(ids)-1 in use, float32 unit vectors
    ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Entry:
    scope: str
    key: str
    response_hash: str
    expires: float


class SemanticIndex:
    """Not thread-safe: the service calls it from its event loop only."""

    def __init__(self, dims: int, max_entries: int, max_per_scope: int, clock: Clock = time.monotonic) -> None:
        if dims < 1 or max_entries < 1 or not 1 <= max_per_scope <= max_entries:
            raise ValueError("dims, max_entries >= 1 and 1 <= max_per_scope <= max_entries")
        self.dims, self.max_entries, self.max_per_scope, self.clock = dims, max_entries, max_per_scope, clock
        self._scopes: dict[str, _Scope] = {}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # insertion order = age
        self._next_id = 0
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def has(self, scope: str) -> bool:
        return scope in self._scopes

    def scopes(self) -> int:
        return len(self._scopes)

    def store(self, policy: str, scope: str, vector: np.ndarray, key: str, ttl_s: float,
              response_hash: str = "") -> None:
        """Add an entry (an entry of the same scope with the same key is replaced)."""
        vector = self._unit(vector)
        s = self._scopes.get(scope)
        if s is not None:
            if s.policy != policy:
                raise ValueError(f"scope {scope[:16]}... belongs to policy {s.policy!r}, not {policy!r}")
            for entry_id in [i for i in s.ids if self._entries[i].key == key]:
                self._remove(entry_id)
        self._drop_expired(scope)
        while (s := self._scopes.get(scope)) is not None and len(s.ids) >= self.max_per_scope:
            self._remove(s.ids[0])  # rows and ids are in age order
            self.evicted += 1
        while len(self._entries) >= self.max_entries:
            self._remove(next(iter(self._entries)))
            self.evicted += 1
        s = self._scopes.get(scope)
        if s is None:
            s = self._scopes[scope] = _Scope(policy, np.empty((min(4, self.max_per_scope), self.dims), np.float32))
        if len(s.ids) == len(s.vectors):
            grown = np.empty((min(2 * len(s.vectors), self.max_per_scope), self.dims), dtype=np.float32)
            grown[: len(s.ids)] = s.vectors[: len(s.ids)]
            s.vectors = grown
        entry_id = self._next_id
        self._next_id += 1
        s.vectors[len(s.ids)] = vector
        s.ids.append(entry_id)
        self._entries[entry_id] = _Entry(scope, key, response_hash, self.clock() + ttl_s)

    def lookup(self, scope: str, vector: np.ndarray) -> Match | None:
        """The scope's most similar live entry, or None (no live entry in this scope)."""
        self._drop_expired(scope)
        s = self._scopes.get(scope)
        if s is None:
            return None
        sims = s.vectors[: len(s.ids)] @ self._unit(vector)
        best = int(np.argmax(sims))
        entry = self._entries[s.ids[best]]
        return Match(entry.key, float(sims[best]), entry.response_hash, entry.expires - self.clock())

    def purge(self, policy: str | None = None, scope: str | None = None) -> int:
        """Drop the entries of a policy, of one scope, or (neither) all; how many were dropped."""
        doomed = [i for i, e in self._entries.items()
                  if (scope is None or e.scope == scope) and (policy is None or self._scopes[e.scope].policy == policy)]
        for entry_id in doomed:
            self._remove(entry_id)
        return len(doomed)

    def sweep(self) -> int:
        """Drop every expired entry (the service runs this now and then; lookups drop their scope's)."""
        now = self.clock()
        doomed = [i for i, e in self._entries.items() if e.expires <= now]
        for entry_id in doomed:
            self._remove(entry_id)
        self.expired += len(doomed)
        return len(doomed)

    def _drop_expired(self, scope: str) -> None:
        s = self._scopes.get(scope)
        if s is None:
            return
        now = self.clock()
        doomed = [i for i in s.ids if self._entries[i].expires <= now]
        for entry_id in doomed:
            self._remove(entry_id)
        self.expired += len(doomed)

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        s = self._scopes[entry.scope]
        row = s.ids.index(entry_id)
        last = len(s.ids) - 1
        # Keep rows in age order (eviction takes the oldest): shift the tail up by one.
        s.vectors[row:last] = s.vectors[row + 1: last + 1]
        del s.ids[row]
        if not s.ids:
            del self._scopes[entry.scope]

    def _unit(self, vector: np.ndarray) -> np.ndarray:
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        if v.shape != (self.dims,) or not np.all(np.isfinite(v)):
            raise ValueError(f"a vector of {self.dims} finite numbers")
        norm = float(np.linalg.norm(v))
        if norm == 0.0:
            raise ValueError("a zero vector has no direction")
        return v / norm
