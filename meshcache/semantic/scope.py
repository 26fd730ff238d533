"""What of a chat completion request must match exactly for a semantic hit (its scope), and the one
text compared by embedding (the last user message). The reference for the filter (issue 38).

The scope is a SHA-256 over: the cache instance that stores the answers (a sidecar's own Envoy
process: the index then only hands a sidecar keys its own store may hold), the policy and its
generation (a purge moves to new scopes), the
caller's principal when the policy is principal-scoped, every request field except `messages`
and the policy's `ignore_fields` (so the model, tools, response_format, sampling parameters,
`stream` and `stream_options` are in it), and every message but the last (system prompt and
history). Only a request whose last message is a user turn with text content has a scope.
Canonical JSON (sorted keys, no spaces, `json.dumps` spelling of strings and floats) makes equal
requests equal. The filter computes the same digest in Rust (filter/core/src/semantic.rs), checked
against this function by tests/semantic/scope_vectors.json (tests/semantic/test_scope_contract.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


class NotEligible(ValueError):
    """The request has no semantic scope (no last user text, or not a chat body)."""


def user_text(message: Any) -> str:
    if not isinstance(message, dict) or message.get("role") != "user":
        raise NotEligible("the last message is not a user message")
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise NotEligible("the last user message has no text content (or non-text parts)")


def semantic_scope(body: dict[str, Any], policy: str, generation: int = 0, principal: str | None = None,
                   ignore_fields: tuple[str, ...] = (), instance: str = "") -> tuple[str, str]:
    """(scope hex digest, last user message text) of a chat completion request body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotEligible("no messages")
    text = user_text(messages[-1])
    rest = {k: v for k, v in body.items() if k != "messages" and k not in ignore_fields}
    scoped = {"instance": instance, "policy": policy, "generation": generation, "principal": principal, "request": rest,
              "history": messages[:-1], "last_message": {k: v for k, v in messages[-1].items() if k != "content"}}
    canonical = json.dumps(scoped, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest(), text
