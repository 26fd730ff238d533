"""SemanticIndex's own rules, on a controlled clock (the service tests run it with the real
embedder): a key stored again replaces its entry, a scope belongs to one policy, storage grows
past its first rows and keeps age order, expiry is exact, bad vectors are refused."""

from __future__ import annotations

import numpy as np
import pytest

from meshcache.semantic.index import SemanticIndex

DIMS = 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _v(i: int) -> np.ndarray:
    v = np.zeros(DIMS, dtype=np.float32)
    v[i % DIMS] = 1.0
    v[(i + 1) % DIMS] = 0.1 * (i // DIMS)
    return v


def test_same_key_replaces_and_growth_keeps_age_order() -> None:
    index = SemanticIndex(DIMS, max_entries=100, max_per_scope=6)
    for i in range(6):  # past the first 4 rows
        index.store("p", "s", _v(i), f"k{i}", 60)
    index.store("p", "s", _v(7), "k2", 60)  # k2 again: replaced, not added
    assert len(index) == 6
    assert index.lookup("s", _v(7)).key == "k2"  # type: ignore[union-attr]
    index.store("p", "s", _v(6), "k6", 60)  # full: the oldest (k0) goes
    assert index.evicted == 1
    assert all(index.lookup("s", _v(i)).key == f"k{i}" for i in (1, 3, 4, 5, 6))  # type: ignore[union-attr]
    assert index.lookup("s", _v(0)).key != "k0"  # type: ignore[union-attr]


def test_expiry_is_exact_and_sweep_counts() -> None:
    clock = Clock()
    index = SemanticIndex(DIMS, max_entries=10, max_per_scope=10, clock=clock)
    index.store("p", "a", _v(0), "short", 5)
    index.store("p", "b", _v(0), "long", 50)
    clock.now += 4.999
    match = index.lookup("a", _v(0))
    assert match is not None and match.key == "short" and match.ttl_left_s == pytest.approx(0.001)
    clock.now += 0.001
    assert index.lookup("a", _v(0)) is None and not index.has("a")
    clock.now += 45
    assert index.sweep() == 1 and len(index) == 0 and index.expired == 2


def test_scope_policy_and_bad_vectors() -> None:
    index = SemanticIndex(DIMS, max_entries=10, max_per_scope=5)
    index.store("p", "s", _v(0) * 3, "k", 60)  # any length: stored as a unit vector
    assert index.lookup("s", _v(0)).similarity == pytest.approx(1.0)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="belongs to policy"):
        index.store("q", "s", _v(1), "k2", 60)
    for bad in (np.zeros(DIMS), np.ones(DIMS + 1), np.full(DIMS, np.nan)):
        with pytest.raises(ValueError):
            index.store("p", "s", bad, "k3", 60)
    assert len(index) == 1
    assert index.purge(policy="q") == 0 and index.purge() == 1
    with pytest.raises(ValueError):
        SemanticIndex(DIMS, max_entries=2, max_per_scope=3)
