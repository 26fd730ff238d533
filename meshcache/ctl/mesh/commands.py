"""`meshcache up|down|status|demo|policy`: the local mesh's command line."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from meshcache.ctl.envoy_config import LB_POLICIES
from meshcache.ctl.interrupts import INTERRUPTED, STOP_SIGNALS, deferred_stop_signals, interrupt
from meshcache.ctl.mesh import state
from meshcache.ctl.mesh.api_client import ApiError, PolicyApi
from meshcache.ctl.mesh.cache_table import format_cache_table
from meshcache.ctl.mesh.config import MAX_REPLICAS, MeshConfig, default_state_dir
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
    lines = [
        f"  app (gRPC + HTTP, plaintext):  {e['app']}   traffic colour {e['app_color']!r}",
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



def _load_config(args: argparse.Namespace) -> MeshConfig:
    overrides: dict[str, Any] = {"state_dir": _state_dir(args)} if args.state_dir or not args.config else {}
    if getattr(args, "replicas", None) is not None:
        overrides["replicas"] = args.replicas
    if getattr(args, "no_affinity", False):
        overrides["affinity"] = False
    if getattr(args, "lb_policy", None):
        overrides["lb_policy"] = args.lb_policy
    config = MeshConfig.from_file(Path(args.config), **overrides) if args.config else MeshConfig(**overrides)
    return config.with_free_ports() if args.free_ports else config


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
        check_prerequisites(config)  # port in use / missing binary: say so at once
        config.log_dir.mkdir(parents=True, exist_ok=True)
        follower = supervisor.LogFollower(config.log_dir / supervisor.SUPERVISOR_LOG, sys.stdout)
        # A signal while the supervisor starts is handled once `proc` names it, so a supervisor
        # never runs on with nobody to stop it.
        with deferred_stop_signals():
            proc = supervisor.spawn(config)
        ready = supervisor.wait_ready(proc, config, follower)
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
    current = state.read_state(state_dir)
    if current is None:
        print(f"no mesh running from {state_dir}")
        return 0
    forced = state.stop_mesh(state_dir, timeout=args.timeout)
    left = state.leftover_children(current)
    if left:
        return _err(f"could not stop: {', '.join(c['name'] for c in left)}")
    print("mesh stopped" + (f" (had to kill: {', '.join(forced)})" if forced else ""))
    return 0


def _health(endpoints: dict[str, Any]) -> dict[str, bool]:
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
    if args.json:
        print(json.dumps({"status": current["status"], "healthy": healthy, "pid": current["pid"],
                          "processes": children, "components": components, "health": health,
                          "certificates": current.get("certificates", {}),
                          "endpoints": current.get("endpoints"), "cache": cache, "cache_error": cache_error}))
        return 0 if healthy else 1
    print(f"mesh {current['status']} (supervisor pid {current['pid']}, state dir {state_dir})")
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
        return demo.run(_state_dir(args))
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
                    # .get: a control plane older than these fields does not list them.
                    print(f"{p['model_prefix']:<24} {p['ttl_s']:>7} {p['max_ttl_s']:>9} {p['generation']:>5} "
                          f"{p['scope']:<9} {p['enabled']!s:<7} {p.get('coalesce_timeout_ms', ''):>11} "
                          f"{p.get('stale_if_error_s', ''):>16} {p.get('stale_while_revalidate_s', ''):>19}")
                return 0
            if args.action == "set":
                spec: dict[str, Any] = {"ttl_s": args.ttl, "scope": args.scope, "enabled": not args.disabled}
                if args.max_ttl is not None:
                    spec["max_ttl_s"] = args.max_ttl
                if args.hash_header:
                    spec["hash_headers"] = args.hash_header
                if args.vary_header:
                    spec["vary_headers"] = args.vary_header
                if args.ignore_field:
                    spec["ignore_fields"] = args.ignore_field
                if args.deterministic_only:
                    spec["deterministic_only"] = True
                for flag, field in (("coalesce_timeout_ms", "coalesce_timeout_ms"),
                                    ("stale_if_error", "stale_if_error_s"),
                                    ("stale_while_revalidate", "stale_while_revalidate_s")):
                    if getattr(args, flag) is not None:
                        spec[field] = getattr(args, flag)
                result = api.put(args.model_prefix, spec)
            elif args.action == "delete":
                result = api.delete(args.model_prefix)
            else:
                result = api.purge(args.model_prefix)
            print(json.dumps(result) if args.json else
                  f"{args.action} {args.model_prefix}: version {result['version']}"
                  + ("" if result["changed"] else " (no change)"))
            return 0
    except (ApiError, OSError) as exc:
        return _err(str(exc))


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = subparsers.add_parser("up", help="start the local mesh (redis, control plane, engines, sidecars)")
    _add_state_dir(up)
    up.add_argument("--detach", action="store_true", help="run in the background; `meshcache down` stops it")
    up.add_argument("--config", help="JSON file of MeshConfig settings (ports, colours, identities, ...)")
    up.add_argument("--free-ports", action="store_true", help="pick free ports instead of the defaults")
    up.add_argument("--replicas", type=int, metavar="N",
                    help=f"engine + server-sidecar pairs, 1 to {MAX_REPLICAS} (default 1); with more than one "
                         "the client sidecar routes by cache affinity")
    up.add_argument("--no-affinity", action="store_true", help="with --replicas: balance round robin instead")
    up.add_argument("--lb-policy", choices=LB_POLICIES, help="consistent hashing for affinity (default RING_HASH)")
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
    demo.set_defaults(func=cmd_demo)

    policy = subparsers.add_parser("policy", help="cache policies (a client of the control-plane API)")
    actions = policy.add_subparsers(dest="action", required=True)
    for name, helptext in (("list", "list the policies"), ("set", "create or change a policy"),
                           ("delete", "delete a policy"), ("purge", "drop a model's cached entries")):
        a = actions.add_parser(name, help=helptext)
        _add_state_dir(a)
        a.add_argument("--url", help="control-plane API (default: the running mesh's)")
        a.add_argument("--token", help="bearer token (default: the running mesh's write token)")
        a.add_argument("--json", action="store_true", help="print the API's JSON answer")
        if name != "list":
            a.add_argument("model_prefix")
        if name == "set":
            a.add_argument("--ttl", type=int, required=True, help="seconds an entry is served")
            a.add_argument("--max-ttl", type=int, help="upper bound for per-response TTLs")
            a.add_argument("--scope", choices=("shared", "principal"), default="shared")
            a.add_argument("--disabled", action="store_true", help="keep the policy but bypass the cache")
            a.add_argument("--hash-header", action="append", help="header hashed into responses (repeat)")
            a.add_argument("--vary-header", action="append", help="header that splits cache entries (repeat)")
            a.add_argument("--ignore-field", action="append",
                           help="top-level JSON body field left out of the key, e.g. user (repeat)")
            a.add_argument("--deterministic-only", action="store_true",
                           help="OpenAI chat/completions: bypass sampled requests (temperature > 0, no seed)")
            a.add_argument("--coalesce-timeout-ms", type=int, metavar="MS",
                           help="identical misses wait this long for the first one's answer (0 = off; default 5000)")
            a.add_argument("--stale-if-error", type=int, metavar="S",
                           help="serve an expired entry up to S seconds past its TTL when the engine fails")
            a.add_argument("--stale-while-revalidate", type=int, metavar="S",
                           help="serve an expired entry at once for S seconds while one request refreshes it")
        a.set_defaults(func=cmd_policy)
