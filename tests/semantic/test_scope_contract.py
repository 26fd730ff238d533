"""The scope contract between meshcache/semantic/scope.py and the filter's Rust copy
(filter/core/src/semantic.rs, whose unit test reads scope_vectors.json): the vectors are what the
Python reference computes today, so a change on one side fails a test until both agree."""

from __future__ import annotations

import json

from tests.semantic import scope_vectors


def test_the_shipped_vectors_are_what_the_reference_computes() -> None:
    shipped = json.loads(scope_vectors.PATH.read_text())
    assert shipped == scope_vectors.vectors()
    scopes = [v["scope"] for v in shipped]
    # Equal requests spelled differently share a scope; the others differ; three have none.
    assert scopes[0] == scopes[1] == scopes[2]
    assert len({s for s in scopes if s}) == len(scopes) - 3 - 2
    assert scopes[-3:] == [None, None, None]
