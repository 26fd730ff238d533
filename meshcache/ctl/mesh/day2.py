"""Day-2 commands: `meshcache policy history|rollback`, `meshcache limits show|set`, and the
confirmation every change that loses cached entries goes through (purge, delete, rollback,
limits).

A change is first sent as a dry run: the control plane answers its diff and its `cache_effects`
(control_plane/cache_effects.py: what the filter empties, evicts or stops serving). Without
effects it is applied at once; with effects, they are printed (with the proxies' current counts
where the control plane can read them) and the change is applied only after a `y` on a terminal,
or with `--yes`; without a terminal and without `--yes` the command refuses in one line. The
change is applied with If-Match on the version the dry run saw, so what was confirmed is what is
applied (412 if the policies moved meanwhile).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from meshcache.contract.filter_config import Limits
from meshcache.ctl.mesh.api_client import ApiError, PolicyApi

REFUSED = 1  # exit status of a change refused for want of confirmation
LIMIT_FLAGS = {name: "--" + name.replace("_", "-") for name in Limits.model_fields}


def _counts(api: PolicyApi, effects: list[dict[str, Any]]) -> dict[str | None, str]:
    """'N entries, B bytes' now cached per affected prefix (None: all), from /v1/stats; empty
    when no proxy's stats can be read (the control plane has no stats sources configured)."""
    try:
        stats = api.stats()
    except ApiError:
        return {}
    if not stats.get("proxies_read"):
        return {}
    models = {m["model_prefix"]: m for m in stats["models"]}
    proxies = [p for p in stats["proxies"] if p["ok"]]
    out: dict[str | None, str] = {}
    for e in effects:
        prefix = e["model_prefix"]
        if prefix is None:
            entries = sum(p.get("entries") or 0 for p in proxies)
            size = sum(p.get("bytes") or 0 for p in proxies)
        elif prefix in models and models[prefix]["entries"] is not None:
            entries, size = models[prefix]["entries"], models[prefix]["bytes"] or 0
        else:
            continue
        noun = "entry" if entries == 1 else "entries"
        read = f"{len(proxies)} prox{'y' if len(proxies) == 1 else 'ies'} read"
        out[prefix] = f"{entries} {noun}, {size} bytes cached now on the {read}"
    return out


def confirm(api: PolicyApi, preview: dict[str, Any], what: str, yes: bool,
            stdin: TextIO = sys.stdin, stderr: TextIO = sys.stderr) -> bool:
    """True if the previewed change may be applied (no cache effects, `--yes`, or a `y`)."""
    effects = preview.get("cache_effects", [])
    if not effects:
        return True
    counts = _counts(api, effects)
    lines = [e["message"] + (f" ({counts[e['model_prefix']]})" if e["model_prefix"] in counts else "")
             for e in effects]
    if yes:
        for line in lines:
            print(f"meshcache: warning: {line}", file=stderr)
        return True
    if not (stdin.isatty() and stderr.isatty()):
        print(f"meshcache: {what} not applied, it loses cached entries: {'; '.join(lines)}; "
              "pass --yes to apply it", file=stderr)
        return False
    print(f"{what} loses cached entries:", file=stderr)
    for line in lines:
        print(f"  - {line}", file=stderr)
    print("apply it? [y/N] ", end="", file=stderr, flush=True)
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        print("meshcache: not applied", file=stderr)
        return False
    return True


def guarded_write(api: PolicyApi, write: Callable[[int | None, bool], dict[str, Any]], what: str, yes: bool,
                  if_match: int | None = None) -> dict[str, Any] | None:
    """Dry run, confirm, apply with If-Match on the dry run's version; None if not confirmed."""
    preview = write(if_match, True)
    if not confirm(api, preview, what, yes):
        return None
    try:
        return write(preview["version"], False)
    except ApiError as exc:
        if exc.status == 412:
            raise ApiError(f"{what} not applied: the policies changed since it was shown ({exc}); "
                           "run the command again to see what it does now", 412) from exc
        raise


def format_change(change: dict[str, Any]) -> list[str]:
    """One history change as lines: what, the prefix, then `field: before -> after`."""
    what, prefix = change["what"], change["model_prefix"]
    head = "limits" if what == "limits" else f"{what} {prefix}"
    if what == "removed":
        return [f"  {head}"]
    fields = [f"{name}: {after}" if what == "added" else f"{name}: {before} -> {after}"
              for name, (before, after) in change["fields"].items()]
    return [f"  {head}: {', '.join(fields)}"]


def format_history(data: dict[str, Any]) -> list[str]:
    out = [f"current version {data['version']}"]
    for s in data["snapshots"]:
        at = dt.datetime.fromtimestamp(s["created_at"], dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        out.append(f"version {s['version']}  {at}  by {s['author'] or '-'}  {s['action']}  "
                   f"({s['policies']} policies)")
        if not s["diff_known"]:
            out.append("  (the version before is older than the retention: no diff)")
        for change in s["changes"]:
            out.extend(format_change(change))
    return out


def _print_result(args: argparse.Namespace, result: dict[str, Any], headline: str) -> None:
    if args.json:
        print(json.dumps(result))
        return
    print(headline + ("" if result["changed"] else " (no change)"))
    for change in result["changes"]:
        for line in format_change(change):
            print(line)


def history(api: PolicyApi, args: argparse.Namespace) -> int:
    data = api.history(args.limit)
    print(json.dumps(data, indent=2) if args.json else "\n".join(format_history(data)))
    return 0


def _guarded(api: PolicyApi, args: argparse.Namespace, write: Callable[[int | None, bool], dict[str, Any]],
             what: str, done: Callable[[dict[str, Any]], str]) -> int:
    """One write that may lose cached entries: shown and confirmed first (guarded_write), then printed."""
    result = guarded_write(api, write, what, args.yes, args.if_match)
    if result is None:
        return REFUSED
    _print_result(args, result, done(result))
    return 0


def rollback(api: PolicyApi, args: argparse.Namespace) -> int:
    return _guarded(api, args, lambda m, dry: api.rollback(args.version, if_match=m, dry_run=dry),
                    f"rollback to version {args.version}",
                    lambda r: f"rolled back to version {args.version}: now version {r['version']}")


def purge(api: PolicyApi, args: argparse.Namespace) -> int:
    if (args.model_prefix is None) == (not args.all):
        print("meshcache: give a model_prefix or --all", file=sys.stderr)
        return 2
    prefix = None if args.all else args.model_prefix
    name = "every policy" if prefix is None else prefix
    return _guarded(api, args, lambda m, dry: api.purge(prefix, if_match=m, dry_run=dry), f"purge {name}",
                    lambda r: f"purge {name}: version {r['version']}")


def delete(api: PolicyApi, args: argparse.Namespace) -> int:
    return _guarded(api, args, lambda m, dry: api.delete(args.model_prefix, if_match=m, dry_run=dry),
                    f"delete {args.model_prefix}", lambda r: f"delete {args.model_prefix}: version {r['version']}")


def limits(api: PolicyApi, args: argparse.Namespace) -> int:
    current, version = api.limits()
    if args.action == "show":
        if args.json:
            print(json.dumps({"version": version, "limits": current}))
        else:
            print(f"limits at policy version {version}")
            for name, value in current.items():
                print(f"  {name:<16} {value}")
        return 0
    given = {name: getattr(args, name) for name in LIMIT_FLAGS if getattr(args, name) is not None}
    if not given:
        print(f"meshcache: nothing to change: give {', '.join(LIMIT_FLAGS.values())}", file=sys.stderr)
        return 2
    wanted = {**current, **given}
    # The If-Match of the dry run: the version the limits just read belong to (or the one given).
    base = args.if_match if args.if_match is not None else version
    result = guarded_write(api, lambda m, dry: api.set_limits(wanted, if_match=m, dry_run=dry),
                           "limits set", args.yes, base)
    if result is None:
        return REFUSED
    _print_result(args, result, f"limits set: version {result['version']}")
    return 0


def add_write_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--yes", action="store_true",
                   help="apply without asking, even when the change loses cached entries (the loss is still printed)")
    p.add_argument("--if-match", type=int, metavar="VERSION",
                   help="apply only if the policies are still at this snapshot version (else 412)")


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    help_of = {
        "max_entry_bytes": "largest answer stored, bytes (lowering it stores fewer answers; stored ones are kept)",
        "max_total_bytes": "bytes per proxy's cache (lowering it evicts down to the new size)",
        "max_entries": "entries per proxy's cache (ANY change empties every proxy's cache: new slot layout)",
    }
    for name, flag in LIMIT_FLAGS.items():
        field = Limits.model_fields[name]
        p.add_argument(flag, dest=name, type=int, metavar="N",
                       help=f"{name}: {help_of.get(name, '')} (default {field.default})")
