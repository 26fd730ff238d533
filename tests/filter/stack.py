"""A real Envoy running the built filter in front of the real test origin: for one test
(`filter_stack`), or shared by a module's tests (`SharedStacks`, the `shared_stack` fixture)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import xxhash
import yaml

from meshcache.contract.paths import FILTER_WASM, filter_native
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import BUFFER_LIMIT_BYTES, CacheProxy, write
from meshcache.ctl.pki import Identity
from tests.helpers.filter_stats import filter_stats_reaching, filter_stats_where
from tests.helpers.kserve import MODEL_INFER

HOSTS = ("wasm", "native")  # the filter's hosts: proxy-wasm and the Envoy dynamic module
DEFAULT_HASH_HEADERS = ("content-type", "x-model-id")
METRICS_FLUSH_S = 0.45  # the filter flushes metrics every 200 ms; each worker on its own tick
# Buffer limits the Envoy under test runs with: the project's configs (16 MiB) and Envoy's
# default (1 MiB, as in an Istio sidecar). Tests of sizes and streaming run under both.
LIMITS = {"project": BUFFER_LIMIT_BYTES, "envoy-default": None}


@dataclass
class Stack:
    listen_port: int
    admin_port: int
    http_port: int
    grpc_port: int
    log_dir: Path
    # The test origin (None when the caller runs its own upstream): tests stop it to make the
    # upstream unreachable.
    origin: procs.Proc | None = None
    # On a shared stack: this test's tag (its models are named `<name>-<tag>`, so its entries
    # are its own) and the origin's call counts when the test began.
    tag: str = ""
    origin_before: dict[str, int] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen_port}{path}"

    def model(self, name: str) -> str:
        """The model name this test uses for `name`: `name` itself on its own stack; on a shared
        stack `<name>-<tag>` (the same policy prefix matches it), so no other test's entries
        answer it."""
        return f"{name}-{self.tag}" if self.tag else name

    def infer_url(self, model: str) -> str:
        """The KServe v2 REST inference URL of `self.model(model)`."""
        return self.url(f"/v2/models/{self.model(model)}/infer")

    def origin_calls(self) -> dict[str, int]:
        """Requests the origin served for this test (on a shared stack: since the test began)."""
        calls = procs.local_http().get(f"http://127.0.0.1:{self.http_port}/calls", timeout=5).json()
        return {k: v - self.origin_before.get(k, 0) for k, v in calls.items()}

    def stats_reaching(self, expected: dict[str, int], timeout: float = 10.0) -> dict[str, int]:
        """The filter's metrics once each one in `expected` reads its value (filter_stats_reaching)."""
        return filter_stats_reaching(self.admin_port, expected, timeout)

    def stats_where(self, check: Callable[[dict[str, int]], None], timeout: float = 10.0) -> dict[str, int]:
        """The filter's metrics once `check` passes on them (filter_stats_where)."""
        return filter_stats_where(self.admin_port, check, timeout)

    def release(self, name: str) -> None:
        """Let the origin answer the requests it holds under `x-origin-hold: name` (tests.filter.origin)."""
        procs.local_http().get(f"http://127.0.0.1:{self.http_port}/release/{name}", timeout=5).raise_for_status()

    def grpc_infer(self, request: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> tuple[bytes, grpc.Call]:
        with grpc.insecure_channel(f"127.0.0.1:{self.listen_port}") as channel:
            call = channel.unary_unary(MODEL_INFER)  # raw bytes in and out: an unmodified grpcio client
            response, c = call.with_call(request, metadata=metadata, timeout=10)
            return response, c


# The hosts filter_stack runs and the Envoy each runs on (meshcache.contract.paths.ENVOYS).
HOST_ENVOYS = {"wasm": "1.40", "native": "1.40", "native-1.39": "1.39"}


@contextlib.contextmanager
def filter_stack(tmp: Path, config: dict[str, Any], concurrency: int = 1,
                 tls: Identity | None = None, allowed_peers: list[str] | None = None,
                 allow_on_headers_stop_iteration: bool = True,
                 buffer_limit_bytes: int | None = BUFFER_LIMIT_BYTES,
                 upstream: tuple[int, int] | None = None,
                 without_grpc_hit_route: bool = False,
                 route_timeout_s: float | None = None,
                 host: str = "wasm", access_log: list[dict[str, Any]] | None = None,
                 envoy_args: list[str] | None = None, semantic_port: int | None = None) -> Iterator[Stack]:
    """`host`: which host of the cache core runs it, `wasm` (the proxy-wasm filter), `native`
    (the Envoy dynamic module, filter/native/; see conftest.py) or `native-1.39` (the module's
    Envoy 1.39 build on Envoy 1.39.3). `upstream`: (HTTP, gRPC) ports
    of a server the caller runs (the engine) instead of the test origin.
    `without_grpc_hit_route`: a misconfigured Envoy lacking the single-pass hit route and Lua
    filter. `route_timeout_s`: the routes' upstream timeout (Envoy answers 504, gRPC UNAVAILABLE,
    past it). `access_log`: Envoy `access_log` entries for the listener's HTTP connection manager.
    `envoy_args`: more Envoy command-line arguments (e.g. `--component-log-level`).
    `semantic_port`: a semantic index service's port, Envoy cluster `SEMANTIC_CLUSTER`."""
    if host not in HOST_ENVOYS:
        raise ValueError(f"host: one of {', '.join(HOST_ENVOYS)}, not {host!r}")
    envoy = HOST_ENVOYS[host]
    listen_port, admin_port = procs.free_port(), procs.free_port()
    started: list[procs.Proc] = []
    origin: procs.Proc | None = None
    with procs.supervised(started):
        if upstream is None:
            http_port, grpc_port = procs.free_port(), procs.free_port()
            origin = procs.start("origin", [sys.executable, "-m", "tests.filter.origin",
                                            "--http-port", str(http_port), "--grpc-port", str(grpc_port)], tmp)
            started.append(origin)
            procs.wait_until(origin, procs.tcp_open(http_port))
            procs.wait_until(origin, procs.tcp_open(grpc_port))
        else:
            http_port, grpc_port = upstream
        proxy = CacheProxy(listen_port=listen_port, admin_port=admin_port, http_upstream_port=http_port,
                           grpc_upstream_port=grpc_port, wasm_path=FILTER_WASM, plugin_config=config,
                           downstream_tls=tls, allowed_peers=allowed_peers or [],
                           allow_on_headers_stop_iteration=allow_on_headers_stop_iteration,
                           buffer_limit_bytes=buffer_limit_bytes,
                           native_module=filter_native(envoy) if host != "wasm" else None,
                           grpc_hit_route=not without_grpc_hit_route, semantic_port=semantic_port,
                           **({"route_timeout_s": route_timeout_s} if route_timeout_s is not None else {}))
        config_path = write(proxy, tmp / "envoy.yaml")
        if access_log:
            _add_access_log(config_path, access_log)
        started.append(launchers.start_envoy(config_path, admin_port, tmp, concurrency=concurrency, envoy=envoy,
                                             extra_args=envoy_args))
        yield Stack(listen_port, admin_port, http_port, grpc_port, tmp, origin)


def _add_access_log(config_path: Path, access_log: list[dict[str, Any]]) -> None:
    doc = yaml.safe_load(config_path.read_text())
    managers = [f["typed_config"] for listener in doc["static_resources"]["listeners"]
                for chain in listener["filter_chains"] for f in chain["filters"]
                if f["typed_config"]["@type"].endswith("HttpConnectionManager")]
    assert managers, f"no HTTP connection manager in {config_path}"
    for manager in managers:
        manager["access_log"] = access_log
    config_path.write_text(yaml.safe_dump(doc, sort_keys=False))


class SharedStacks:
    """Stacks a module's tests share, one per (config, host, options), started on first use and
    stopped with the module: each wasm Envoy costs about a second of CPU to start (V8 compiles
    the module). For tests that stop no component and assert only on their own models' answers,
    origin calls and per-test counts, never on cache-wide counters or gauges."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._open: dict[str, Stack] = {}
        self._exit = contextlib.ExitStack()
        self._tests = 0

    def get(self, config: dict[str, Any], host: str, **options: Any) -> Stack:
        """This test's view of the shared stack for `config`, `host` and `filter_stack` options."""
        key = json.dumps([config, host, options], sort_keys=True, default=str)
        if key not in self._open:
            tmp = self._tmp.mktemp(f"shared-{host}")
            self._open[key] = self._exit.enter_context(filter_stack(tmp, config, host=host, **options))
        stack = self._open[key]
        self._tests += 1
        return dataclasses.replace(stack, tag=f"t{self._tests}", origin_before=stack.origin_calls())

    def close(self) -> None:
        self._exit.close()


def expected_hash(
    body: bytes, headers: httpx.Headers | dict[str, str], names: tuple[str, ...] = DEFAULT_HASH_HEADERS
) -> str:
    """The response hash computed independently of the filter, from its definition (docs/filter.md):
    `xxh3-128:` and the XXH3-128 (reference implementation, Python `xxhash`) of the body length,
    the body and the hashed headers."""
    h = xxhash.xxh3_128(len(body).to_bytes(8, "big") + body)
    lower = {k.lower(): v for k, v in headers.items()}
    for name in sorted(names):
        if name in lower:
            h.update(f"{name}:{lower[name]}\n".encode())
    return "xxh3-128:" + h.hexdigest()


def policy(prefix: str = "m", **fields: Any) -> dict[str, Any]:
    return {"model_prefix": prefix, "ttl_s": 60, **fields}


def config(*policies: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"version": "1", "policies": list(policies) or [policy()], **fields}


def infer_request(model: str, version: str = "", request_id: bytes = b"", extra: bytes = b"") -> bytes:
    """A KServe v2 ModelInferRequest: model_name (1), model_version (2), id (3), then `extra`
    (more fields, e.g. parameters (4), that shape the answer)."""
    msg = b"\x0a" + bytes([len(model)]) + model.encode()
    if version:
        msg += b"\x12" + bytes([len(version)]) + version.encode()
    if request_id:
        msg += b"\x1a" + bytes([len(request_id)]) + request_id
    return msg + extra
