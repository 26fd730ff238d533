"""The console script: settings from env vars, tokens from a file, refusing bad configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from meshcache.ctl import procs
from meshcache.ctl.procs import local_http
from tests.engine.helpers import init_demo_models, running_engine
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
        r = local_http().put(f"http://127.0.0.1:{http_port}/v1/policies/m", json={"ttl_s": 1},
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
    r = subprocess.run([SCRIPT, "--istiod-debug", "istiod:15014/debug"],
                       env={**env, "MESHCACHE_CP_TOKENS": "read:viewer:" + "r" * 24},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "istiod_debug: 'istiod:15014/debug' is not an http(s) URL" in r.stderr


def test_meshcache_policy_set_carries_coalescing_and_stale_flags(cp: ControlPlaneProc) -> None:
    """`meshcache policy set --coalesce-timeout-ms --stale-if-error --stale-while-revalidate`
    against a real control plane: the fields reach the policy and the filter's config; out-of-range
    values are the API's 422, naming the field, and change nothing."""
    cli = [str(Path(sys.executable).parent / "meshcache"), "policy", "set", "resnet-mini", "--url", cp.url,
           "--token", WRITE_TOKEN, "--ttl", "60"]
    ok = subprocess.run([*cli, "--coalesce-timeout-ms", "250", "--stale-if-error", "600",
                         "--stale-while-revalidate", "30", "--client-no-cache", "ignore"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    with cp.client() as c:
        policy = c.get("/v1/policies/resnet-mini").json()["policy"]
        row = json.loads(c.get("/v1/snapshot").json()["plugin_config"])["policies"][0]
    fields = {"coalesce_timeout_ms": 250, "stale_if_error_s": 600, "stale_while_revalidate_s": 30,
              "client_no_cache": "ignore"}
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


def test_meshcache_policy_set_changes_only_the_flags_given(start_cp: Any, tmp_path: Path) -> None:
    """`meshcache policy set` against a real control plane (and a real engine's model index):
    only the flags given change, the field diff applied is printed, --replace is the explicit
    full replace, a prefix no engine serves is applied with a warning."""
    meshcache = str(Path(sys.executable).parent / "meshcache")
    with running_engine(init_demo_models(tmp_path / "models"), tmp_path / "engine") as engine:
        cp = start_cp(extra_env={"MESHCACHE_CP_ENGINE_INDEX": engine.http_url})

        def policy(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([meshcache, "policy", "set", *args, "--url", cp.url, "--token", WRITE_TOKEN],
                                  capture_output=True, text=True, timeout=60)

        def fields() -> dict[str, Any]:
            with cp.client() as c:
                return c.get("/v1/policies/resnet-mini").json()["policy"]  # type: ignore[no-any-return]

        # README's two consecutive examples: the second keeps the first's max_ttl_s.
        first = policy("resnet-mini", "--ttl", "300", "--max-ttl", "1800")
        assert first.returncode == 0 and first.stderr == "", first.stderr
        assert first.stdout.splitlines()[0] == "set resnet-mini: version 1"
        assert "  ttl_s: 300" in first.stdout and "  max_ttl_s: 1800" in first.stdout
        second = policy("resnet-mini", "--ttl", "300", "--coalesce-timeout-ms", "2000", "--stale-if-error", "600")
        assert second.returncode == 0, second.stderr
        assert second.stdout.splitlines() == ["set resnet-mini: version 2", "  coalesce_timeout_ms: 5000 -> 2000",
                                              "  stale_if_error_s: 0 -> 600"]
        now = fields()
        assert (now["max_ttl_s"], now["coalesce_timeout_ms"], now["stale_if_error_s"]) == (1800, 2000, 600)
        # --unset resets one field to its default; --disabled only that.
        reset = policy("resnet-mini", "--unset", "stale_if_error_s", "--disabled")
        assert reset.stdout.splitlines()[1:] == ["  enabled: True -> False", "  stale_if_error_s: 600 -> 0"]
        assert (fields()["max_ttl_s"], fields()["coalesce_timeout_ms"], fields()["enabled"]) == (1800, 2000, False)
        same = policy("resnet-mini", "--disabled")
        assert same.stdout.strip() == "set resnet-mini: version 3 (no change)"
        # If-Match: a stale version changes nothing.
        stale = policy("resnet-mini", "--ttl", "5", "--if-match", "1")
        assert stale.returncode == 1 and "412" in stale.stderr and fields()["ttl_s"] == 300
        # The full replace is explicit, and needs the TTL.
        assert policy("resnet-mini", "--replace", "--max-ttl", "900").returncode == 1
        replaced = policy("resnet-mini", "--replace", "--ttl", "200")
        assert replaced.returncode == 0 and replaced.stdout.splitlines()[0] == "replaced resnet-mini: version 4"
        assert "  coalesce_timeout_ms: 2000 -> 5000" in replaced.stdout and fields()["max_ttl_s"] == 200
        # Creating needs a TTL; the API says which field is missing.
        missing = policy("text-embedder", "--stale-if-error", "5")
        assert missing.returncode == 1 and "ttl_s: is required" in missing.stderr
        # A prefix no engine serves a model for: applied, with a warning.
        typo = policy("renset-mini", "--ttl", "60")
        assert typo.returncode == 0 and typo.stdout.startswith("set renset-mini: version 5")
        assert "warning: model_prefix 'renset-mini' matches no model the engines serve" in typo.stderr
