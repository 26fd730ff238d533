"""Day-2 commands against a real control plane and Redis: `meshcache policy history|rollback`,
`meshcache limits show|set`, and the confirmation of every change that loses cached entries
(limits, purge --all, delete, rollback): refused without a terminal unless `--yes`, asked on a
terminal, and in every refusal nothing is written."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from meshcache.contract.filter_config import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_TOTAL_BYTES
from meshcache.control_plane.xds_client import XdsClient, plugin_config_of
from tests.helpers.control_plane import WRITE_TOKEN, ControlPlaneProc, run

MESHCACHE = str(Path(sys.executable).parent / "meshcache")


def cli(cp: ControlPlaneProc, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`meshcache ARGS --url --token` with a pipe as stdin (no terminal)."""
    return subprocess.run([MESHCACHE, *args, "--url", cp.url, "--token", WRITE_TOKEN], input=stdin,
                          capture_output=True, text=True, timeout=60)


def served(cp: ControlPlaneProc) -> dict[str, Any]:
    """The plugin configuration the control plane serves now (what it pushes to Envoy)."""
    with cp.client() as c:
        return json.loads(c.get("/v1/snapshot").json()["plugin_config"])  # type: ignore[no-any-return]


def audit_size(cp: ControlPlaneProc) -> int:
    with cp.client() as c:
        return len(c.get("/v1/audit").json()["entries"])


def test_history_shows_the_diff_and_rollback_pushes_the_old_policy(cp: ControlPlaneProc) -> None:
    assert cli(cp, "policy", "set", "resnet", "--ttl", "300").returncode == 0  # version 1
    assert cli(cp, "policy", "set", "resnet", "--ttl", "60").returncode == 0  # version 2

    history = cli(cp, "policy", "history")
    assert history.returncode == 0, history.stderr
    lines = history.stdout.splitlines()
    assert lines[0] == "current version 2"
    v2 = lines.index(next(line for line in lines if line.startswith("version 2 ")))
    assert "patch resnet" in lines[v2]
    assert lines[v2 + 1] == "  changed resnet: ttl_s: 300 -> 60"
    assert any(line.startswith("  added resnet: ttl_s: 300, max_ttl_s: 300") for line in lines[v2 + 2:])

    async def rollback_pushed() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            client = XdsClient(ch, "day2-rollback")
            await client.subscribe()
            first = await client.recv()
            assert plugin_config_of(first)["version"] == "2"
            await client.ack(first)
            # No cache effect (a TTL only): applied at once, without --yes and without a terminal.
            done = await asyncio.to_thread(cli, cp, "policy", "rollback", "1")
            assert done.returncode == 0, done.stderr
            assert done.stdout.splitlines() == ["rolled back to version 1: now version 3",
                                                "  changed resnet: ttl_s: 60 -> 300"]
            pushed = await client.recv()
            await client.close()
            return plugin_config_of(pushed)

    pushed = run(rollback_pushed())
    assert pushed["version"] == "3"
    assert [(p["model_prefix"], p["ttl_s"]) for p in pushed["policies"]] == [("resnet", 300)]
    newest = json.loads(cli(cp, "policy", "history", "--json", "--limit", "1").stdout)
    assert [(s["version"], s["action"]) for s in newest["snapshots"]] == [(3, "rollback to 1")]


def test_limits_show_and_set_change_the_served_config(cp: ControlPlaneProc) -> None:
    shown = cli(cp, "limits", "show")
    assert shown.returncode == 0, shown.stderr
    assert f"  max_total_bytes  {DEFAULT_MAX_TOTAL_BYTES}" in shown.stdout.splitlines()
    # Raising a bound loses nothing: applied without --yes, other limits kept.
    raised = cli(cp, "limits", "set", "--max-total-bytes", str(2 * DEFAULT_MAX_TOTAL_BYTES))
    assert raised.returncode == 0, raised.stderr
    assert raised.stdout.splitlines() == [
        "limits set: version 1",
        f"  limits: max_total_bytes: {DEFAULT_MAX_TOTAL_BYTES} -> {2 * DEFAULT_MAX_TOTAL_BYTES}"]
    assert raised.stderr == ""
    config = served(cp)
    assert (config["max_total_bytes"], config["max_entries"]) == (2 * DEFAULT_MAX_TOTAL_BYTES, DEFAULT_MAX_ENTRIES)
    assert json.loads(cli(cp, "limits", "show", "--json").stdout)["version"] == 1
    # Invalid: the API's 422, nothing written.
    bad = cli(cp, "limits", "set", "--max-total-bytes", "1000")  # below max_entry_bytes
    assert bad.returncode == 1 and "422" in bad.stderr and "max_total_bytes: must be at least max_entry_bytes" \
        in bad.stderr, bad.stderr
    assert served(cp)["version"] == "1"


def test_a_change_that_loses_entries_refuses_without_yes_and_writes_nothing(cp: ControlPlaneProc) -> None:
    assert cli(cp, "policy", "set", "resnet", "--ttl", "300").returncode == 0
    assert cli(cp, "policy", "set", "bert", "--ttl", "300").returncode == 0
    before, entries_before = served(cp), audit_size(cp)
    refusals = {
        ("limits", "set", "--max-entries", "1024"): "max_entries 16384 -> 1024 changes the cache's slot layout",
        ("limits", "set", "--max-total-bytes", "1048576"): "every proxy evicts entries until its cache holds at "
                                                           "most 1048576 bytes",
        ("limits", "set", "--max-entry-bytes", "1024"): "answers over 1024 bytes are no longer stored",
        ("policy", "purge", "--all"): "the cached entries of 'bert' are no longer served (purged",
        ("policy", "purge", "resnet"): "the cached entries of 'resnet' are no longer served (purged",
        ("policy", "delete", "bert"): "the cached entries of 'bert' are no longer served (policy removed",
        ("policy", "rollback", "1"): "the cached entries of 'bert' are no longer served (policy removed",
    }
    for args, loss in refusals.items():
        r = cli(cp, *args, stdin="y\n")  # a pipe, not a terminal: the answer is not read
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert r.stdout == "" and len(r.stderr.splitlines()) == 1, (args, r.stderr)
        assert loss in r.stderr and r.stderr.rstrip().endswith("pass --yes to apply it"), (args, r.stderr)
    assert served(cp) == before and audit_size(cp) == entries_before  # nothing written

    applied = cli(cp, "limits", "set", "--max-entries", "1024", "--yes")
    assert applied.returncode == 0, applied.stderr
    assert applied.stderr.splitlines() == [
        "meshcache: warning: max_entries 16384 -> 1024 changes the cache's slot layout: every proxy empties its "
        "whole cache (all entries of all models are lost)"]
    assert served(cp)["max_entries"] == 1024
    purged = cli(cp, "policy", "purge", "--all", "--yes", "--json")
    assert purged.returncode == 0, purged.stderr
    result = json.loads(purged.stdout)
    assert [e["what"] for e in result["cache_effects"]] == ["purged", "purged"]
    generations = {p["model_prefix"]: p["generation"] for p in served(cp)["policies"]}
    assert generations == {"bert": result["version"], "resnet": result["version"]}


def test_the_api_dry_run_says_what_a_write_would_lose_and_writes_nothing(cp: ControlPlaneProc) -> None:
    with cp.client() as c:
        assert c.put("/v1/policies/resnet", json={"ttl_s": 60}).status_code == 200
        dry = c.put("/v1/limits", params={"dry_run": "true"}, json={"max_entries": 64})
        assert dry.status_code == 200 and dry.headers["ETag"] == '"1"'
        body = dry.json()
        assert body["dry_run"] and body["changed"] and body["version"] == 1
        assert body["cache_effects"] == [{"what": "emptied", "model_prefix": None, "message": body["warnings"][0]}]
        assert c.get("/v1/limits").json()["max_entries"] == DEFAULT_MAX_ENTRIES
        # A stale If-Match is refused in a dry run as in the write.
        stale = c.put("/v1/limits", params={"dry_run": "true"}, json={"max_entries": 64}, headers={"If-Match": '"0"'})
        assert stale.status_code == 412
        # The write answers the same effects, applied.
        done = c.put("/v1/limits", json={"max_entries": 64}, headers={"If-Match": '"1"'}).json()
        assert (done["dry_run"], done["version"], done["cache_effects"]) == (False, 2, body["cache_effects"])
        # purge: exactly one of model_prefix and all.
        assert c.post("/v1/purge", json={"model_prefix": "resnet", "all": True}).status_code == 422
        assert c.post("/v1/purge", json={}).status_code == 422


def test_on_a_terminal_it_asks_and_only_yes_applies(cp: ControlPlaneProc) -> None:
    assert cli(cp, "policy", "set", "resnet", "--ttl", "300").returncode == 0

    def on_terminal(answer: bytes) -> tuple[int, str]:
        main, child = pty.openpty()
        proc = subprocess.Popen([MESHCACHE, "limits", "set", "--max-entries", "2048", "--url", cp.url,
                                 "--token", WRITE_TOKEN], stdin=child, stdout=subprocess.PIPE, stderr=child)
        os.close(child)
        seen, deadline = b"", time.monotonic() + 60
        while b"[y/N]" not in seen:  # bounded: a command that never asks fails here
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([main], [], [], 1.0)[0]:
                seen += os.read(main, 4096)
        os.write(main, answer)
        proc.wait(timeout=60)
        assert proc.stdout is not None
        out = proc.stdout.read().decode()
        proc.stdout.close()
        os.close(main)
        return proc.returncode, seen.decode() + out

    code, text = on_terminal(b"n\n")
    assert code == 1 and "limits set loses cached entries:" in text and "max_entries 16384 -> 2048" in text
    assert served(cp)["max_entries"] == DEFAULT_MAX_ENTRIES
    code, text = on_terminal(b"y\n")
    assert code == 0 and "limits set: version 2" in text, text
    assert served(cp)["max_entries"] == 2048
