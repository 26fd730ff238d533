"""The console script: settings from env vars, tokens from a file, refusing bad configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from meshcache.ctl import procs
from tests.helpers.control_plane import WRITE_TOKEN, ControlPlaneProc

SCRIPT = str(Path(sys.executable).parent / "meshcache-control-plane")


def test_env_settings_and_tokens_file(tmp_path: Path, redis_server: tuple[procs.Proc, int]) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# role:name:token\nwrite:ops:file-token-0123456789abcdef\n")
    http_port, xds_port = procs.free_port(), procs.free_port()
    env = {"MESHCACHE_CP_REDIS_URL": f"redis://127.0.0.1:{redis_server[1]}/0",
           "MESHCACHE_CP_HTTP_PORT": str(http_port), "MESHCACHE_CP_XDS_PORT": str(xds_port)}
    proc = procs.start("cp-env", [SCRIPT, "--tokens-file", str(tokens)], tmp_path, env=env)
    try:
        procs.wait_until(proc, procs.http_ok(f"http://127.0.0.1:{http_port}/readyz"))
        procs.wait_until(proc, procs.tcp_open(xds_port))
        r = httpx.put(f"http://127.0.0.1:{http_port}/v1/policies/m", json={"ttl_s": 1},
                      headers={"Authorization": "Bearer file-token-0123456789abcdef"})
        assert r.status_code == 200 and r.json()["version"] == 1
    finally:
        proc.stop()


def test_refuses_to_start_without_tokens_or_with_bad_ones(tmp_path: Path) -> None:
    env = {"MESHCACHE_CP_TOKENS": "", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no API tokens configured" in r.stderr
    r = subprocess.run([SCRIPT], env={**env, "MESHCACHE_CP_TOKENS": "admin:short"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "read|write:name:token" in r.stderr
    r = subprocess.run([SCRIPT, "--http-port", "70000"], env={**env, "MESHCACHE_CP_TOKENS": "x"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "http_port" in r.stderr


def test_meshcache_policy_set_carries_coalescing_and_stale_flags(cp: ControlPlaneProc) -> None:
    """`meshcache policy set --coalesce-timeout-ms --stale-if-error --stale-while-revalidate`
    against a real control plane: the fields reach the policy and the filter's config; out-of-range
    values are the API's 422, naming the field, and change nothing."""
    cli = [str(Path(sys.executable).parent / "meshcache"), "policy", "set", "resnet-mini", "--url", cp.url,
           "--token", WRITE_TOKEN, "--ttl", "60"]
    ok = subprocess.run([*cli, "--coalesce-timeout-ms", "250", "--stale-if-error", "600",
                         "--stale-while-revalidate", "30"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    with cp.client() as c:
        policy = c.get("/v1/policies/resnet-mini").json()["policy"]
        row = json.loads(c.get("/v1/snapshot").json()["plugin_config"])["policies"][0]
    fields = {"coalesce_timeout_ms": 250, "stale_if_error_s": 600, "stale_while_revalidate_s": 30}
    assert {k: policy[k] for k in fields} == {k: row[k] for k in fields} == fields
    bad = subprocess.run([*cli, "--coalesce-timeout-ms", "60001"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "422" in bad.stderr and "coalesce_timeout_ms" in bad.stderr, bad.stderr
    with cp.client() as c:
        assert c.get("/v1/policies/resnet-mini").json()["policy"]["coalesce_timeout_ms"] == 250
    listed = subprocess.run([str(Path(sys.executable).parent / "meshcache"), "policy", "list", "--url", cp.url,
                             "--token", WRITE_TOKEN], capture_output=True, text=True, timeout=60)
    header, row = listed.stdout.splitlines()[1:3]
    assert header.split()[-3:] == ["coalesce_ms", "stale_if_error_s", "stale_while_reval_s"]
    assert row.split()[0] == "resnet-mini" and row.split()[-3:] == ["250", "600", "30"]
