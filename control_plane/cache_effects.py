"""What a change does to the entries the sidecars already cache, derived from its diff
(history.diff), so a write and its dry run say the same thing.

The filter's rules (filter/core/src/store.rs `reconcile`, insert.rs, docs/filter.md "Store"):
- a new `max_entries` (up or down) changes the slot layout: every slot is emptied, the whole
  cache is lost on every proxy;
- a lower `max_total_bytes` evicts entries (slot order) until the cache fits the new budget;
- a lower `max_entry_bytes` keeps stored entries, but answers above it are no longer stored;
- a purge gives the policy a new generation: its stored entries are never served again (they
  stay, unattributed to nothing servable, until evicted);
- a removed policy's entries are never served again either (its requests bypass the cache, and
  a re-created policy gets a new generation).
Raising `max_total_bytes`/`max_entry_bytes` loses nothing. Lowering a TTL or disabling a policy
is not counted here: the entries stay stored (a TTL bounds how long each is served; `enabled`
false hides them until it is true again).
"""

from __future__ import annotations

from typing import Any

from .schemas import CacheEffect


def _limit_effects(fields: dict[str, list[Any]]) -> list[CacheEffect]:
    out = []
    if "max_entries" in fields:
        before, after = fields["max_entries"]
        out.append(CacheEffect(
            what="emptied", model_prefix=None,
            message=f"max_entries {before} -> {after} changes the cache's slot layout: every proxy empties its "
                    "whole cache (all entries of all models are lost)"))
    if "max_total_bytes" in fields:
        before, after = fields["max_total_bytes"]
        if after < before:
            out.append(CacheEffect(
                what="evicted", model_prefix=None,
                message=f"max_total_bytes {before} -> {after}: every proxy evicts entries until its cache holds "
                        f"at most {after} bytes"))
    if "max_entry_bytes" in fields:
        before, after = fields["max_entry_bytes"]
        if after < before:
            out.append(CacheEffect(
                what="shrunk", model_prefix=None,
                message=f"max_entry_bytes {before} -> {after}: answers over {after} bytes are no longer stored "
                        "(entries already stored are kept until they expire or are evicted)"))
    return out


def effects(diff: list[dict[str, Any]]) -> list[CacheEffect]:
    """The cache effects of a change whose `history.diff` is `diff` (empty: loses nothing)."""
    out: list[CacheEffect] = []
    for change in diff:
        what, prefix = change["what"], change["model_prefix"]
        if what == "limits":
            out.extend(_limit_effects(change["fields"]))
        elif what == "purged" or (what == "changed" and "generation" in change["fields"]):
            out.append(CacheEffect(what="purged", model_prefix=prefix,
                                   message=f"the cached entries of {prefix!r} are no longer served (purged: new "
                                           "generation, new keys)"))
        elif what == "removed":
            out.append(CacheEffect(what="removed", model_prefix=prefix,
                                   message=f"the cached entries of {prefix!r} are no longer served (policy removed; "
                                           "its requests bypass the cache)"))
    return out
