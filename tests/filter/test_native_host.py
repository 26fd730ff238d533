"""What is particular to the dynamic-module host (filter/native/, issue 24) in a real Envoy 1.40
(and, for the ABI it speaks, Envoy 1.39.3 with the module's 1.39 build, issue 37).

The cache's behaviour is tested against both hosts by the parametrized suite (the `host`
fixture, tests/filter/conftest.py); this file holds what only this host has: Envoy loading the
module (ABI version matched), the store in process memory shared by Envoy's workers, holding
back under Envoy's default buffer limit, Envoy rejecting an invalid config.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from meshcache.contract.paths import envoy_binary, require_filter_native
from meshcache.ctl import launchers
from meshcache.ctl.envoy_config import CacheProxy, write
from tests.filter.stack import config, filter_stack, policy

INFER = "/v2/models/m/infer"
BODY = b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}'
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(("stack_host", "envoy", "abi"),
                         [("native", "1.40", "v0.2.0"), ("native-1.39", "1.39", "v0.1.0")],
                         ids=["envoy-1.40", "envoy-1.39"])
def test_module_loads_with_the_abi_version_envoy_expects(tmp_path: Path, stack_host: str, envoy: str,
                                                         abi: str) -> None:
    require_filter_native(envoy)
    with filter_stack(tmp_path, config(), host=stack_host):
        log = (tmp_path / "envoy.log").read_text()
    # Envoy only warns on a mismatched ABI version ("... is deprecated") and loads the module
    # anyway: assert the match.
    assert f"Dynamic module ABI version {abi} matched." in log, log[-2000:]
    assert "deprecated" not in log


@pytest.mark.parametrize(("envoy", "abi"), [("1.40", "v0.2.0"), ("1.39", "v0.1.0")])
def test_each_build_names_its_abi_in_an_exported_symbol(envoy: str, abi: str) -> None:
    nm = shutil.which("nm")
    assert nm, "nm (binutils, which the native build's linker comes with) is missing"
    out = subprocess.run([nm, "-D", "--defined-only", str(require_filter_native(envoy))],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert any(line.split()[-1:] == ["meshcache_envoy_abi"] for line in out.splitlines()), out[-500:]
    # Its value ("envoy-<minor> <abi>") is checked in filter/native/src/abi.rs's unit tests.


@pytest.mark.parametrize(("module", "envoy", "why"), [
    ("1.40", "1.39", "speaks Envoy 1.40's dynamic-module ABI (v0.2.0) and this Envoy is older"),
    ("1.39", "1.40", "speaks Envoy 1.39's dynamic-module ABI (v0.1.0) and this Envoy is newer"),
], ids=["1.40-module-on-envoy-1.39", "1.39-module-on-envoy-1.40"])
def test_a_module_for_the_other_envoy_is_refused_with_the_reason(tmp_path: Path, module: str, envoy: str,
                                                                  why: str) -> None:
    # Both Envoys would load the other's module with only a warning; the module refuses itself
    # (program_init returns null), so Envoy rejects the config with an error, and exits: no crash.
    proxy = CacheProxy(listen_port=1, admin_port=2, http_upstream_port=3, native_module=require_filter_native(module),
                       plugin_config=config())
    path = write(proxy, tmp_path / "envoy.yaml")
    result = subprocess.run([envoy_binary(envoy), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                            capture_output=True, text=True, timeout=60)
    log = result.stdout + result.stderr
    assert result.returncode == 1, (result.returncode, log[-2000:])
    assert why in log, log[-2000:]
    instead = "libmeshcache_native-envoy-1.39.so" if envoy == "1.39" else "libmeshcache_native.so"
    assert f"use {instead}" in log
    assert f"Failed to initialize dynamic module: {require_filter_native(module)}" in log
    assert "Caught" not in log and "backtrace" not in log


def test_miss_is_stored_then_hits_come_from_the_store(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(), host="native") as s, httpx.Client() as c:
        first = c.post(s.url(INFER), content=BODY, headers=JSON)
        assert first.status_code == 200
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
        for _ in range(3):
            hit = c.post(s.url(INFER), content=BODY, headers=JSON)
            assert hit.status_code == 200
            assert hit.content == first.content
            assert hit.headers["cache-status"] == "meshcache; hit; ttl=60"
            assert hit.headers["content-type"] == "application/json"
            assert 0 <= int(hit.headers["age"]) <= 60  # seconds since stored, within the TTL
        assert s.origin_calls()["http"] == 1

        other = c.post(s.url(INFER), content=BODY.replace(b"[1, 2]}", b"[1, 3]}"), headers=JSON)
        assert other.headers["cache-status"] == "meshcache; fwd=miss; stored", "another body, another key"
        other_model = c.post(s.url("/v2/models/m2/infer"), content=BODY, headers=JSON)
        assert other_model.headers["cache-status"] == "meshcache; fwd=miss; stored", "another path, another key"
        assert s.origin_calls()["http"] == 3


def test_a_body_in_many_chunks_keys_like_the_same_body_in_one(tmp_path: Path) -> None:
    def chunks() -> Iterator[bytes]:
        for i in range(0, len(BODY), 7):
            yield BODY[i:i + 7]

    with filter_stack(tmp_path, config(), host="native") as s, httpx.Client() as c:
        first = c.post(s.url(INFER), content=chunks(), headers=JSON)  # chunked transfer coding
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
        hit = c.post(s.url(INFER), content=BODY, headers=JSON)
        assert hit.headers["cache-status"].startswith("meshcache; hit")
        assert hit.content == first.content


def test_what_passes_through_uncached(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(policy("m"), max_entry_bytes=4096), host="native") as s, \
            httpx.Client() as c:
        no_policy = c.post(s.url("/v2/models/zz/infer"), content=BODY, headers=JSON)
        assert no_policy.headers["cache-status"] == "meshcache; fwd=bypass; detail=no-policy"
        not_inference = c.post(s.url("/other"), content=BODY, headers=JSON)
        assert not_inference.status_code == 200 and "cache-status" not in not_inference.headers
        big = c.post(s.url(INFER), content=BODY, headers={**JSON, "x-origin-size": "20000"})
        assert big.headers["cache-status"] == "meshcache; fwd=miss; detail=too-big"
        assert len(big.content) == 20000, "the answer passes through whole"
        failed = c.post(s.url(INFER), content=BODY, headers={**JSON, "x-origin-status": "503"})
        assert failed.status_code == 503 and failed.headers["cache-status"] == "meshcache; fwd=miss; detail=status"
        big_request = c.post(s.url(INFER), content=b"[" + b"1," * 400_000 + b"1]", headers=JSON)
        assert big_request.status_code == 200
        assert big_request.headers["cache-status"] == "meshcache; fwd=bypass; detail=too-big"
        again = [c.post(s.url(INFER), content=BODY, headers={**JSON, "x-origin-size": "20000"}),
                 c.post(s.url(INFER), content=BODY, headers={**JSON, "x-origin-status": "503"})]
        assert [r.headers["cache-status"] for r in again] == ["meshcache; fwd=miss; detail=too-big",
                                                            "meshcache; fwd=miss; detail=status"], "nothing was stored"


def test_holding_back_stays_under_envoys_default_buffer_limit(tmp_path: Path) -> None:
    # Envoy's default 1 MiB buffer limit (an Istio sidecar's) and entries allowed up to 9 MiB: a
    # 2 MiB answer streams through whole (never a 500 from an overflowing buffer), copied for the
    # store while it passes, and the next identical request is answered from the store.
    with filter_stack(tmp_path, config(max_entry_bytes=9 * 1_048_576), buffer_limit_bytes=None, host="native") as s, \
            httpx.Client() as c:
        big = c.post(s.url(INFER), content=BODY, headers={**JSON, "x-origin-size": str(2 * 1_048_576)}, timeout=30)
        assert big.status_code == 200 and len(big.content) == 2 * 1_048_576
        assert big.headers["cache-status"] == "meshcache; fwd=miss"
        hit = c.post(s.url(INFER), content=BODY, headers={**JSON, "x-origin-size": str(2 * 1_048_576)}, timeout=30)
        assert hit.headers["cache-status"].startswith("meshcache; hit"), hit.headers
        assert hit.content == big.content
        assert s.origin_calls()["http"] == 1


def test_workers_share_one_store(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(), concurrency=2, host="native") as s:
        with httpx.Client() as c:
            stored = c.post(s.url(INFER), content=BODY, headers=JSON)
        assert stored.headers["cache-status"] == "meshcache; fwd=miss; stored"

        def fresh_connection(_: int) -> tuple[str, bytes]:
            # A new connection each time: Envoy's listener spreads them over both workers.
            with httpx.Client() as c:
                r = c.post(s.url(INFER), content=BODY, headers=JSON)
                return r.headers["cache-status"], r.content

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(fresh_connection, range(64)))
        assert all(st.startswith("meshcache; hit") and body == stored.content for st, body in answers), answers[:3]
        assert s.origin_calls()["http"] == 1
        per_worker = {k: v for k, v in launchers.envoy_stats(s.admin_port, "listener.").items()
                      if ".worker_" in k and k.endswith(".downstream_cx_total")}
        assert len(per_worker) == 2 and all(v > 0 for v in per_worker.values()), per_worker


def test_an_invalid_config_is_rejected_by_envoy(tmp_path: Path) -> None:
    proxy = CacheProxy(listen_port=1, admin_port=2, http_upstream_port=3, native_module=require_filter_native(),
                       plugin_config={"policies": [{"model_prefix": "m"}]})  # no ttl_s
    path = write(proxy, tmp_path / "envoy.yaml")
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "policies[0].ttl_s: is required" in result.stdout + result.stderr
