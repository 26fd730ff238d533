"""`meshcache up|down|status|demo|policy|limits`: the local mesh's command line."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import httpx

from meshcache.contract.filter_config import POLICY_FIELD_HELP, ClientNoCache
from meshcache.ctl.envoy_config import LB_POLICIES
from meshcache.ctl.interrupts import INTERRUPTED, STOP_SIGNALS, deferred_stop_signals, interrupt
from meshcache.ctl.mesh import day2, state
from meshcache.ctl.mesh.api_client import ApiError, PolicyApi
from meshcache.ctl.mesh.cache_table import format_cache_table
from meshcache.ctl.mesh.config import FILTER_HOSTS, HOST_NAMES, MAX_REPLICAS, MeshConfig, default_state_dir
from meshcache.ctl.mesh.errors import MeshError


def _err(message: str) -> int:
    print(f"meshcache: {message}", file=sys.stderr)
    return 1


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else default_state_dir()


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", help="where the mesh keeps its data, certificates and logs "
                                       "(default $MESHCACHE_STATE_DIR or ~/.local/state/meshcache)")


# ---- up / down / status ----------------------------------------------------------------------

def format_endpoints(endpoints: dict[str, Any]) -> str:
    e = endpoints
    if e.get("mode") == "istiod":
        return format_istiod_endpoints(e)
    if e.get("mode") == "kube":
        return format_kube_endpoints(e)
    lines = [
        f"  app (gRPC + HTTP, plaintext):  {e['app']}   traffic colour {e['app_color']!r}",
        # .get: a mesh started before the field existed ran the Wasm filter.
        f"  cache in the server sidecars:  {HOST_NAMES[e.get('filter', 'wasm')]}",
        f"  control-plane API:             {e['control_plane_api']}   (write token in {e['token_file']})",
        f"  status page:                   {e['control_plane_api']}/status   (sign in with that token)",
        f"  Envoy admin:                   client {e['client_sidecar_admin']}   server {e['server_sidecar_admin']}",
        f"  server sidecar (mTLS only):    {e['server_sidecar_mtls']}   identity {e['server_identity']}",
        f"  engine:                        {e['engine_http']}   gRPC {e['engine_grpc']}   "
        f"metrics {e['engine_metrics']}",
    ]
    if "replicas" in e:
        lines.append(f"  replicas ({e['routing']}):")
        for k, r in enumerate(e["replicas"], start=1):
            lines.append(f"    {k}: server sidecar {r['server_sidecar_mtls']} (admin {r['server_sidecar_admin']})"
                         f"   engine {r['engine_http']}")
    if "canary_color" in e:
        lines.append(f"  canary engine (colour {e['canary_color']!r}): metrics {e['canary_engine_metrics']}")
    return "\n".join(lines)


def format_istiod_endpoints(e: dict[str, Any]) -> str:
    lines = [
        f"  app (the client pod's sidecar): REST {e['app_http']}   gRPC {e['app_grpc']}   "
        f"(Host / :authority {e['app_authority']}; x-traffic-color: {e['canary_color'] or '-'} for the canary)",
        f"  control-plane API:             {e['control_plane_api']}   (write token in {e['token_file']})",
        f"  status page:                   {e['control_plane_api']}/status   (sign in with that token)",
        f"  control-plane metrics:         {e['control_plane_api']}/metrics",
        f"  control-plane MCP (for istiod): {e['control_plane_xds']}",
        f"  istiod:                        xDS {e['istiod_xds']}   debug {e['istiod_debug']}/syncz",
    ]
    # .get: a mesh started before the field existed.
    for pod, url in e.get("engine_metrics", {}).items():
        lines.append(f"  engine {pod:<33} metrics {url}")
    for proxy, sc in e["sidecars"].items():
        lines.append(f"  sidecar {proxy:<32} pod IP {sc['ip']:<15} admin {sc['admin']}   "
                     f"stats {sc['admin']}/stats/prometheus")
    return "\n".join(lines)


def format_kube_endpoints(e: dict[str, Any]) -> str:
    return "\n".join([
        f"  app (the client pod's sidecar): REST {e['app_http']}   gRPC {e['app_grpc']}   "
        f"(Host / :authority {e['app_authority']})",
        f"  kubectl:                       kubectl --kubeconfig {e['kubeconfig']} -n {e['namespace']} get pods",
        f"  control-plane API:             {e['control_plane_api']}   (write token in {e['token_file']})",
        f"  status page:                   {e['control_plane_api']}/status   (sign in with that token)",
        f"  control-plane MCP (for istiod): {e['control_plane_xds']}",
        f"  istiod:                        debug {e['istiod_debug']}/syncz",
    ])


def format_pods(pods: list[dict[str, Any]]) -> str:
    lines = ["pods (from the API server):"]
    for p in pods:
        sidecar = f"istio-proxy injected ({'ready' if p['sidecar_ready'] else 'NOT READY'})" if p["injected"] \
            else "no sidecar"
        lines.append(f"  {p['name']:<44} {p['ip'] or '-':<15} {p['phase']:<8} "
                     f"{'ready' if p['ready'] else 'not ready':<10} {sidecar}")
    return "\n".join(lines)


def headline(status: str, healthy: bool, failing: list[str]) -> str:
    """The first line of `meshcache status`: never "ready" next to a failing check."""
    if status == "ready" and not healthy:
        return f"mesh DEGRADED: {', '.join(failing) if failing else 'not every check passes'}"
    return f"mesh {status}"


def _load_config(args: argparse.Namespace) -> MeshConfig:
    overrides: dict[str, Any] = {"state_dir": _state_dir(args)} if args.state_dir or not args.config else {}
    if getattr(args, "replicas", None) is not None:
        # --kube: the engine Deployment's pods (each with its sidecar and cache), not local pairs.
        overrides["kube_replicas" if getattr(args, "kube", False) else "replicas"] = args.replicas
    if getattr(args, "no_affinity", False):
        overrides["affinity"] = False
    if getattr(args, "lb_policy", None):
        overrides["lb_policy"] = args.lb_policy
    if getattr(args, "istiod", False):
        overrides["istiod"] = True
    if getattr(args, "kube", False):
        overrides["kube"] = True
    if getattr(args, "filter", None):
        overrides["filter"] = args.filter
    config = MeshConfig.from_file(Path(args.config), **overrides) if args.config else MeshConfig(**overrides)
    return config.with_free_ports() if args.free_ports and not (config.istiod or config.kube) else config


def cmd_up(args: argparse.Namespace) -> int:
    from meshcache.ctl.mesh import supervisor
    from meshcache.ctl.mesh.topology import check_prerequisites

    if args.supervise:  # internal: the background process started below (it has its own handlers)
        try:
            return supervisor.supervise(_load_config(args))
        except (OSError, ValueError, TypeError) as exc:
            return _err(f"bad configuration: {exc}")
    # Ctrl-C/SIGTERM/SIGHUP from here until the mesh is up: an orderly stop of whatever was started
    # (follow() takes over once up). SIGINT explicitly too: a shell starts background jobs with it
    # ignored. main() has raised KeyboardInterrupt for them since its first line; this only adds
    # the ignored ones.
    for sig in STOP_SIGNALS:
        signal.signal(sig, interrupt)
    proc: subprocess.Popen[bytes] | None = None
    config: MeshConfig | None = None
    try:
        try:
            config = _load_config(args)
        except (OSError, ValueError, TypeError) as exc:
            return _err(f"bad configuration: {exc}")
        current = state.read_state(config.state_dir)
        if state.running(current):
            assert current is not None
            return _err(f"a mesh is already running from {config.state_dir} (pid {current['pid']}); "
                        f"`meshcache down --state-dir {config.state_dir}` stops it")
        if current is not None:
            state.stop_mesh(config.state_dir, timeout=5)  # a stale record: stop any leftovers
        if config.kube:
            from meshcache.ctl.kube.up import check_prerequisites as check_kube_prerequisites

            check_kube_prerequisites()
        elif config.istiod:
            from meshcache.ctl.istiod.mesh import check_prerequisites as check_istiod_prerequisites

            check_istiod_prerequisites(config.filter)  # missing binary: say so at once (ports are picked free)
        else:
            check_prerequisites(config)  # port in use / missing binary: say so at once
        config.log_dir.mkdir(parents=True, exist_ok=True)
        follower = supervisor.LogFollower(config.log_dir / supervisor.SUPERVISOR_LOG, sys.stdout)
        # A signal while the supervisor starts is handled once `proc` names it, so a supervisor
        # never runs on with nobody to stop it.
        with deferred_stop_signals():
            proc = supervisor.spawn(config)
        ready = supervisor.wait_ready(proc, config, follower, **({"timeout": supervisor.KUBE_READY_TIMEOUT_S}
                                                                 if config.kube else {}))
        print(f"\nmeshcache mesh is up (state dir {config.state_dir}, supervisor pid {ready['pid']}):")
        print(format_endpoints(ready["endpoints"]), flush=True)
        if args.detach:
            print(f"\nrunning in the background; stop it with: meshcache down --state-dir {config.state_dir}")
            return 0
        return supervisor.follow(proc, config, follower, banner="\nCtrl-C stops the mesh.")
    except MeshError as exc:
        assert config is not None
        return _err(f"{exc}\n(all logs: {config.log_dir})")
    except KeyboardInterrupt:
        # A second Ctrl-C must not cut the stop short (and leave children running).
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if proc is None:
            print("interrupted: nothing was started", flush=True)
        else:
            print("interrupted: stopping what was started ...", flush=True)
            assert config is not None
            supervisor.stop_supervisor(proc, config)
        return INTERRUPTED


def cmd_down(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    from meshcache.ctl.kube.up import remove_leftovers

    current = state.read_state(state_dir)
    if current is None:
        removed = remove_leftovers(state_dir)  # a `up --kube` that died before recording itself
        print(f"no mesh running from {state_dir}" + (f"; removed its leftovers: {', '.join(removed)}"
                                                      if removed else ""))
        return 0
    forced = state.stop_mesh(state_dir, timeout=args.timeout)
    removed = remove_leftovers(state_dir)  # the supervisor removes them; not if it was killed
    left = state.leftover_children(current)
    if left:
        return _err(f"could not stop: {', '.join(c['name'] for c in left)}")
    print("mesh stopped" + (f" (had to kill: {', '.join(forced)})" if forced else "")
          + (f" (removed leftovers: {', '.join(removed)})" if removed else ""))
    return 0


def _health(endpoints: dict[str, Any]) -> dict[str, bool]:
    if endpoints.get("mode") in ("istiod", "kube"):
        return _istiod_health(endpoints)
    checks = {
        "app path (client sidecar -> mTLS -> server sidecar -> engine)":
            f"http://{endpoints['app']}/v2/health/ready",
        "control plane": f"{endpoints['control_plane_api']}/readyz",
        "client sidecar": f"{endpoints['client_sidecar_admin']}/ready",
        "server sidecar": f"{endpoints['server_sidecar_admin']}/ready",
    }
    for k, r in enumerate(endpoints.get("replicas", [])[1:], start=2):
        checks[f"server sidecar {k}"] = f"{r['server_sidecar_admin']}/ready"
    out = {}
    for name, url in checks.items():
        try:
            out[name] = httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            out[name] = False
    return out


def _istiod_health(e: dict[str, Any]) -> dict[str, bool]:
    checks = {
        "app path (client sidecar -> mTLS -> engine sidecar -> engine, config from istiod)":
            (f"{e['app_http']}/v2/health/ready", {"host": e["app_authority"]}),
        "control plane": (f"{e['control_plane_api']}/readyz", {}),
        "istiod": (f"{e['istiod_debug']}/syncz", {}),
        # .get: the kube mesh's sidecars are in their pods (pods and istiod's sync state cover them).
        **{f"sidecar {proxy}": (f"{sc['admin']}/ready", {}) for proxy, sc in e.get("sidecars", {}).items()},
    }
    out = {}
    for name, (url, headers) in checks.items():
        try:
            out[name] = httpx.get(url, headers=headers, timeout=2).status_code == 200
        except httpx.HTTPError:
            out[name] = False
    return out


def _istiod_sync(endpoints: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None]:
    """istiod's per-proxy sync state (/debug/syncz), or why not."""
    if endpoints.get("mode") not in ("istiod", "kube"):
        return None, None
    from meshcache.ctl.istiod.status import proxy_sync

    try:
        return proxy_sync(endpoints["istiod_debug"]), None
    except (httpx.HTTPError, ValueError) as exc:
        return None, f"istiod unreachable: {exc}"


def _kube_pods(current: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The kube mesh's pods as the API server reports them, or why not."""
    endpoints = current.get("endpoints") or {}
    if endpoints.get("mode") != "kube":
        return None, None
    from meshcache.ctl.kube.up import kube_pods

    try:
        return kube_pods(endpoints["kubeconfig"], endpoints["namespace"]), None
    except (MeshError, OSError, ValueError, subprocess.SubprocessError) as exc:
        return None, f"API server unreachable: {exc}"


def _cache_stats(current: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The control plane's per-model cache counters (what the status page shows), or why not."""
    endpoints = current.get("endpoints") or {}
    try:
        token = Path(endpoints["token_file"]).read_text().strip()
        with PolicyApi(endpoints["control_plane_api"], token, timeout=5) as api:
            return api.stats(), None
    except (KeyError, OSError, ApiError) as exc:
        return None, f"counters unavailable: {exc}"


def cmd_status(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    current = state.read_state(state_dir)
    if not state.running(current):
        print(f"no mesh running from {state_dir}")
        return 1
    assert current is not None
    children = {c["name"]: state.pid_alive(int(c["pid"]), c.get("start_time")) for c in current["children"]}
    health = _health(current["endpoints"]) if current["status"] == "ready" else {}
    # A component being restarted, or given up on, is not healthy even if a pid answers.
    settled = all(c.get("state", "running") == "running" for c in current["children"])
    healthy = current["status"] == "ready" and settled and all(children.values()) and all(health.values())
    components = {c["name"]: {"pid": c["pid"], "running": children[c["name"]], "state": c.get("state", "running"),
                              "restarts": c.get("restarts", 0), "last_exit": c.get("last_exit", ""),
                              "note": c.get("note", "")} for c in current["children"]}
    cache, cache_error = _cache_stats(current) if current["status"] == "ready" else (None, None)
    if cache is not None and (cache.get("serving") or {}).get("degraded"):
        healthy = False  # serving the last good snapshot, but its store is unreachable
    sync, sync_error = _istiod_sync(current.get("endpoints") or {}) if current["status"] == "ready" else (None, None)
    pods, pods_error = _kube_pods(current) if current["status"] == "ready" else (None, None)
    if pods is not None:
        from meshcache.ctl.kube.up import pod_ok

        healthy = healthy and all(pod_ok(p) for p in pods)
    elif pods_error:
        healthy = False
    if sync is not None:
        expected = set((current.get("endpoints") or {}).get("sidecars", {}))
        if pods is not None:  # kube: every injected pod's sidecar (proxy id <pod>.<namespace>)
            namespace = current["endpoints"]["namespace"]
            expected = {f"{p['name']}.{namespace}" for p in pods if p["injected"]}
        healthy = healthy and expected <= {p["proxy"] for p in sync if p["synced"]}
    elif sync_error:
        healthy = False
    if args.json:
        print(json.dumps({"status": current["status"], "healthy": healthy, "pid": current["pid"],
                          "processes": children, "components": components, "health": health,
                          "certificates": current.get("certificates", {}),
                          "endpoints": current.get("endpoints"), "cache": cache, "cache_error": cache_error,
                          **({"istiod": {"proxies": sync, "error": sync_error}}
                             if current.get("endpoints", {}).get("mode") in ("istiod", "kube") else {}),
                          **({"pods": pods, "pods_error": pods_error}
                             if current.get("endpoints", {}).get("mode") == "kube" else {})}))
        return 0 if healthy else 1
    failing = [n for n, c in components.items() if c["state"] != "running" or not c["running"]]
    failing += [n for n, ok in health.items() if not ok]
    if sync is not None:
        failing += [f"sidecar {p['proxy']} not synced" for p in sync if not p["synced"]]
    elif sync_error:
        failing.append("istiod sync state")
    if pods is not None:
        from meshcache.ctl.kube.up import pod_ok

        failing += [f"pod {p['name']} not ready" for p in pods if not pod_ok(p)]
    elif pods_error:
        failing.append("pods")
    print(f"{headline(current['status'], healthy, failing)} (supervisor pid {current['pid']}, state dir {state_dir})")
    for name, c in components.items():
        shown = c["state"] if c["state"] != "running" or c["running"] else "EXITED"
        extra = "".join(f"; {part}" for part in (f"last exit: {c['last_exit']}" if c["last_exit"] else "",
                                                 c["note"]) if part)
        print(f"  {name:<16} pid {c['pid']:<8} {shown.upper() if shown != 'running' else shown:<11} "
              f"restarts {c['restarts']}{extra}")
    for name, ok in health.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    for name, until in current.get("certificates", {}).items():
        print(f"  certificate of the {name} valid until {until} (rotated automatically, served over SDS)")
    if sync is not None:
        print("istiod sync state (/debug/syncz):")
        for p in sync:
            types = ", ".join(f"{t} {v}" for t, v in p["types"].items())
            print(f"  {'ok  ' if p['synced'] else 'FAIL'} {p['proxy']:<36} {types}")
    elif sync_error:
        print(f"istiod: {sync_error}")
    if pods is not None:
        print(format_pods(pods))
    elif pods_error:
        print(f"pods: {pods_error}")
    if current.get("endpoints"):
        print(format_endpoints(current["endpoints"]))
    if cache is not None:
        print(format_cache_table(cache))
    elif cache_error:
        print(f"cache: {cache_error}")
    return 0 if healthy else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from meshcache.ctl.mesh import demo

    try:
        return demo.run(_state_dir(args), istiod=args.istiod, host=args.filter, kube=args.kube, llm=args.llm)
    except (MeshError, ApiError) as exc:
        return _err(str(exc))


# ---- policy ----------------------------------------------------------------------------------

def _api(args: argparse.Namespace) -> PolicyApi:
    url, token = args.url, args.token
    if not url or not token:
        current = state.read_state(_state_dir(args))
        if not current or not current.get("endpoints"):
            raise ApiError(f"no running mesh in {_state_dir(args)}: pass --url and --token")
        url = url or current["endpoints"]["control_plane_api"]
        token = token or Path(current["endpoints"]["token_file"]).read_text().strip()
    return PolicyApi(url, token)


# `policy set` flags -> policy fields (None: the flag was not given).
_SET_FLAGS = {"ttl": "ttl_s", "max_ttl": "max_ttl_s", "scope": "scope", "enabled": "enabled",
              "hash_header": "hash_headers", "vary_header": "vary_headers", "ignore_field": "ignore_fields",
              "deterministic_only": "deterministic_only", "coalesce_timeout_ms": "coalesce_timeout_ms",
              "stale_if_error": "stale_if_error_s", "stale_while_revalidate": "stale_while_revalidate_s",
              "client_no_cache": "client_no_cache"}
# `policy set --semantic-threshold T --semantic-shadow`: the members of the policy's `semantic`.
_SEMANTIC_MEMBERS = ("threshold", "shadow")


def _format_changes(result: dict[str, Any]) -> list[str]:
    """The field diff a write applied (the status page's), one line per field."""
    lines = []
    for change in result.get("changes", []):
        for name, (before, after) in change["fields"].items():
            lines.append(f"  {name}: {after}" if change["what"] == "added" else f"  {name}: {before} -> {after}")
    return lines


def _kube_typo_warnings(args: argparse.Namespace) -> list[str]:
    """A kube mesh's control plane cannot read its engines' model index (they are behind their
    sidecars): the CLI reads it inside the engine pods (meshcache/ctl/kube/model_index.py). Only
    for the mesh of the state dir, not for an API given by --url."""
    if args.url:
        return []
    current = state.read_state(_state_dir(args))
    if not current or current.get("endpoints", {}).get("mode") != "kube":
        return []
    from meshcache.ctl.kube.model_index import typo_warnings

    return typo_warnings(current["endpoints"], args.model_prefix)


def _policy_set(api: PolicyApi, args: argparse.Namespace) -> int:
    """Changes only the fields whose flags are given (PATCH; a missing policy is created from the
    defaults), or, with --replace, sets the whole policy (PUT: fields not given take defaults)."""
    fields = {field: getattr(args, flag) for flag, field in _SET_FLAGS.items() if getattr(args, flag) is not None}
    # The semantic layer is one object: its flags set its members (a patch merges them into it).
    semantic = {member: getattr(args, f"semantic_{member}") for member in _SEMANTIC_MEMBERS
                if getattr(args, f"semantic_{member}") is not None}
    if semantic:
        fields["semantic"] = semantic
    if args.replace:
        if args.unset:
            return _err("--unset resets fields of a patch; with --replace every field not given is reset")
        if "ttl_s" not in fields:
            return _err("--replace sets the whole policy: --ttl is required")
        result = api.put(args.model_prefix, fields, if_match=args.if_match)
    else:
        overlap = set(args.unset or ()) & set(fields)
        if overlap:
            return _err(f"--unset {', '.join(sorted(overlap))} and a value for it at once")
        if not fields and not args.unset:
            return _err("nothing to change: give the fields to set (see --help)")
        result = api.patch(args.model_prefix, {**fields, **dict.fromkeys(args.unset or ())}, if_match=args.if_match)
    for warning in [*result.get("warnings", []), *_kube_typo_warnings(args)]:
        print(f"meshcache: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
        return 0
    verb = "replaced" if args.replace else "set"
    print(f"{verb} {args.model_prefix}: version {result['version']}" + ("" if result["changed"] else " (no change)"))
    for line in _format_changes(result):
        print(line)
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    try:
        with _api(args) as api:
            if args.action == "list":
                data = api.policies()
                if args.json:
                    print(json.dumps(data, indent=2))
                    return 0
                print(f"policy version {data['version']}")
                print(f"{'model_prefix':<24} {'ttl_s':>7} {'max_ttl_s':>9} {'gen':>5} {'scope':<9} {'enabled':<7} "
                      f"{'coalesce_ms':>11} {'stale_if_error_s':>16} {'stale_while_reval_s':>19}")
                for p in data["policies"]:
                    print(f"{p['model_prefix']:<24} {p['ttl_s']:>7} {p['max_ttl_s']:>9} {p['generation']:>5} "
                          f"{p['scope']:<9} {p['enabled']!s:<7} {p['coalesce_timeout_ms']:>11} "
                          f"{p['stale_if_error_s']:>16} {p['stale_while_revalidate_s']:>19}")
                return 0
            if args.action == "set":
                return _policy_set(api, args)
            action = {"delete": day2.delete, "purge": day2.purge, "history": day2.history,
                      "rollback": day2.rollback}[args.action]
            return action(api, args)
    except (ApiError, OSError) as exc:
        return _err(str(exc))


def cmd_limits(args: argparse.Namespace) -> int:
    try:
        with _api(args) as api:
            return day2.limits(api, args)
    except (ApiError, OSError) as exc:
        return _err(str(exc))


def _add_set_flags(a: argparse.ArgumentParser) -> None:
    h = POLICY_FIELD_HELP
    a.add_argument("--ttl", type=int, metavar="S", help=f"ttl_s: {h['ttl_s']} (needed to create a policy)")
    a.add_argument("--max-ttl", type=int, metavar="S", help=f"max_ttl_s: {h['max_ttl_s']}")
    a.add_argument("--scope", choices=("shared", "principal"), help=f"scope: {h['scope']}")
    on_off = a.add_mutually_exclusive_group()
    on_off.add_argument("--enabled", dest="enabled", action="store_const", const=True, help="enabled: true")
    on_off.add_argument("--disabled", dest="enabled", action="store_const", const=False,
                        help=f"enabled: {h['enabled']}")
    a.add_argument("--hash-header", action="append", metavar="NAME",
                   help=f"hash_headers (repeat; the list given replaces the policy's): {h['hash_headers']}")
    a.add_argument("--vary-header", action="append", metavar="NAME",
                   help=f"vary_headers (repeat; replaces the list): {h['vary_headers']}")
    a.add_argument("--ignore-field", action="append", metavar="FIELD",
                   help=f"ignore_fields (repeat; replaces the list): {h['ignore_fields']}")
    det = a.add_mutually_exclusive_group()
    det.add_argument("--deterministic-only", dest="deterministic_only", action="store_const", const=True,
                     help=f"deterministic_only: {h['deterministic_only']}")
    det.add_argument("--no-deterministic-only", dest="deterministic_only", action="store_const", const=False,
                     help="deterministic_only: false")
    a.add_argument("--coalesce-timeout-ms", type=int, metavar="MS",
                   help=f"coalesce_timeout_ms: {h['coalesce_timeout_ms']} (default 5000)")
    a.add_argument("--stale-if-error", type=int, metavar="S", help=f"stale_if_error_s: {h['stale_if_error_s']}")
    a.add_argument("--stale-while-revalidate", type=int, metavar="S",
                   help=f"stale_while_revalidate_s: {h['stale_while_revalidate_s']}")
    a.add_argument("--client-no-cache", choices=get_args(ClientNoCache),
                   help=f"client_no_cache: {h['client_no_cache']}")
    a.add_argument("--semantic-threshold", type=float, metavar="T",
                   help=f"semantic.threshold (turns the layer on; 0 < T <= 1, default 0.999): {h['semantic']}")
    shadow = a.add_mutually_exclusive_group()
    shadow.add_argument("--semantic-shadow", dest="semantic_shadow", action="store_const", const=True,
                        help="semantic.shadow: true (turns the layer on in shadow mode: look up and record, serve "
                             "nothing from it)")
    shadow.add_argument("--no-semantic-shadow", dest="semantic_shadow", action="store_const", const=False,
                        help="semantic.shadow: false (serve semantic hits)")
    a.add_argument("--unset", action="append", metavar="FIELD",
                   choices=sorted((set(_SET_FLAGS.values()) - {"ttl_s"}) | {"semantic"}),
                   help="reset a field to its default (repeat)")
    a.add_argument("--replace", action="store_true",
                   help="set the whole policy: every field not given takes its default (PUT)")
    a.add_argument("--if-match", type=int, metavar="VERSION",
                   help="apply only if the policies are still at this snapshot version (else 412)")


def _add_filter(p: argparse.ArgumentParser, which: str) -> None:
    p.add_argument("--filter", choices=FILTER_HOSTS,
                   help=f"what runs the cache in the server sidecars{which}: wasm, the proxy-wasm filter (default, "
                        "what Istio loads), or native, the Envoy dynamic module (filter/dist/libmeshcache_native.so)")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = subparsers.add_parser("up", help="start the local mesh (redis, control plane, engines, sidecars)")
    _add_state_dir(up)
    up.add_argument("--detach", action="store_true", help="run in the background; `meshcache down` stops it")
    up.add_argument("--config", help="JSON file of MeshConfig settings (ports, colours, identities, ...)")
    up.add_argument("--free-ports", action="store_true", help="pick free ports instead of the defaults")
    up.add_argument("--replicas", type=int, metavar="N",
                    help=f"engine + server-sidecar pairs, 1 to {MAX_REPLICAS} (default 1); with more than one "
                         "the client sidecar routes by cache affinity. With --kube: the engine Deployment's "
                         "pods (default as rendered, 2)")
    up.add_argument("--no-affinity", action="store_true", help="with --replicas: balance round robin instead")
    up.add_argument("--lb-policy", choices=LB_POLICIES, help="consistent hashing for affinity (default RING_HASH)")
    up.add_argument("--istiod", action="store_true",
                    help="a real istiod in the middle: control plane -> istiod (MCP) -> sidecars (docs/istio.md)")
    up.add_argument("--kube", action="store_true",
                    help="Kubernetes in the loop: a local cluster, istiod in Kubernetes mode, injected engine pods "
                         "and a client pod run by the test kubelet (root; docs/istio.md)")
    _add_filter(up, "")
    up.add_argument("--supervise", action="store_true", help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_up)

    down = subparsers.add_parser("down", help="stop a mesh started with `meshcache up --detach`")
    _add_state_dir(down)
    down.add_argument("--timeout", type=float, default=60.0, help="seconds before processes are killed")
    down.set_defaults(func=cmd_down)

    status = subparsers.add_parser("status", help="is the mesh running and healthy (exit 0 if so)")
    _add_state_dir(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    demo = subparsers.add_parser("demo", help="inference through the mesh: hits, misses, TTL change, purge")
    _add_state_dir(demo)
    demo.add_argument("--istiod", action="store_true",
                      help="without a running mesh: start a private one with a real istiod in the middle")
    demo.add_argument("--kube", action="store_true",
                      help="without a running mesh: start a private `up --kube` mesh (Kubernetes in the loop)")
    demo.add_argument("--llm", action="store_true",
                      help="OpenAI-compatible chat completions (the engine's LLM demo models) instead of KServe v2")
    _add_filter(demo, " of the private mesh (a running mesh keeps its own)")
    demo.set_defaults(func=cmd_demo)

    policy = subparsers.add_parser("policy", help="cache policies (a client of the control-plane API)")
    actions = policy.add_subparsers(dest="action", required=True)
    for name, helptext in (("list", "list the policies"),
                           ("set", "change the fields given, keep the others (creates the policy with defaults "
                                   "if missing); --replace sets the whole policy"),
                           ("delete", "delete a policy (its cached entries are no longer served: asks first)"),
                           ("purge", "drop a model's cached entries, or every model's with --all (asks first)"),
                           ("history", "the recent policy snapshots, newest first, each with what it changed"),
                           ("rollback", "a new snapshot with the policies and limits of an older VERSION "
                                        "(asks first if it loses cached entries)")):
        a = actions.add_parser(name, help=helptext)
        _add_api_flags(a)
        if name in ("set", "delete"):
            a.add_argument("model_prefix")
        if name == "set":
            _add_set_flags(a)
        if name == "purge":
            a.add_argument("model_prefix", nargs="?")
            a.add_argument("--all", action="store_true", help="purge every policy: the whole cache stops being served")
        if name == "rollback":
            a.add_argument("version", type=int, metavar="VERSION", help="the snapshot to go back to (see history)")
        if name in ("delete", "purge", "rollback"):
            day2.add_write_flags(a)
        if name == "history":
            a.add_argument("--limit", type=int, default=20, metavar="N", help="snapshots shown (1 to 100, default 20)")
        a.set_defaults(func=cmd_policy)

    limits = subparsers.add_parser("limits", help="the caches' global limits (a client of the control-plane API)")
    limit_actions = limits.add_subparsers(dest="action", required=True)
    show = limit_actions.add_parser("show", help="the current limits")
    _add_api_flags(show)
    show.set_defaults(func=cmd_limits)
    lset = limit_actions.add_parser("set", help="change the limits given, keep the others (asks first if the "
                                                "change empties or shrinks the caches)")
    _add_api_flags(lset)
    day2.add_limit_flags(lset)
    day2.add_write_flags(lset)
    lset.set_defaults(func=cmd_limits)


def _add_api_flags(a: argparse.ArgumentParser) -> None:
    _add_state_dir(a)
    a.add_argument("--url", help="control-plane API (default: the running mesh's)")
    a.add_argument("--token", help="bearer token (default: the running mesh's write token)")
    a.add_argument("--json", action="store_true", help="print the API's JSON answer")
