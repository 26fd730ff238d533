"""Warnings for `meshcache istio validate`: requests that the ALLOW AuthorizationPolicies on the
cached pods would deny without anyone meaning it.

- A container port that no ALLOW rule admits: an ALLOW policy denies everything no rule matches,
  so a port outside every rule (Triton's metrics 8002, a health or admin port) answers 403 to all,
  Prometheus included.
- A port admitted only to callers with a mesh identity (`principals`, `namespaces`) where no
  PeerAuthentication in the manifests makes mTLS STRICT: under PERMISSIVE (Istio's default) or
  DISABLE, plaintext callers (pods without a sidecar, other meshes) get through mTLS and are then
  denied by the policy (403), which looks like a bug of the server, not of the mesh.

Warnings, not errors: the policies may be exactly what the user wants, and the mesh-wide
PeerAuthentication lives in istio-system, outside these manifests (pass it with `--workload`).
Only what the manifests show is judged: other ALLOW policies of the namespace that the user did
not pass would admit more.
"""

from __future__ import annotations

from typing import Any

from .crossref import _name, _of, _pod_labels, _selects, _workloads, injected

Obj = dict[str, Any]
ROOT_NAMESPACE = "istio-system"  # Istio's default root namespace: its selector-less PeerAuthentication is mesh-wide
IDENTITY_FIELDS = ("principals", "namespaces")  # source fields only an mTLS peer can match


def _namespace(o: Obj) -> str | None:
    return (o.get("metadata") or {}).get("namespace")


def _same_namespace(a: Obj, b: Obj) -> bool:
    """Objects without a namespace (a bare file) go wherever they are applied: taken as the same."""
    return _namespace(a) is None or _namespace(b) is None or _namespace(a) == _namespace(b)


def _applies(policy: Obj, w: Obj) -> bool:
    sel = (policy["spec"].get("selector") or {}).get("matchLabels")
    return _same_namespace(policy, w) and (not sel or _selects(sel, _pod_labels(w)))


def _admits(rule: Obj, port: int) -> bool:
    """Whether some request to `port` can match the rule's `to` (no `to`: every port)."""
    tos = rule.get("to")
    if not tos:
        return True
    for to in tos:
        op = to.get("operation") or {}
        if "ports" in op and str(port) not in [str(p) for p in op["ports"]]:
            continue
        if "notPorts" in op and str(port) in [str(p) for p in op["notPorts"]]:
            continue
        return True
    return False


def _needs_identity(rule: Obj) -> bool:
    """Whether every source the rule admits must present a mesh (mTLS) identity."""
    sources = rule.get("from")
    return bool(sources) and all(any((s.get("source") or {}).get(k) for k in IDENTITY_FIELDS) for s in sources)


def mtls_mode(objects: list[Obj], w: Obj, port: int) -> tuple[str, str]:
    """(mode, which PeerAuthentication says so) for a workload's port: the workload's own policy
    (its port level first), then its namespace's, then the mesh-wide one; else Istio's default."""
    peers = _of(objects, "PeerAuthentication")
    own = [p for p in peers if (p["spec"].get("selector") or {}).get("matchLabels") and _applies(p, w)]
    namespace = [p for p in peers if not (p["spec"].get("selector") or {}).get("matchLabels")
                 and _namespace(p) != ROOT_NAMESPACE and _same_namespace(p, w)]
    mesh = [p for p in peers if not (p["spec"].get("selector") or {}).get("matchLabels")
            and _namespace(p) == ROOT_NAMESPACE]
    for p in own:
        by_port = p["spec"].get("portLevelMtls") or {}
        level = by_port.get(str(port)) or by_port.get(port)
        if level and level.get("mode", "UNSET") != "UNSET":
            return level["mode"], f"PeerAuthentication/{_name(p)}"
    for group in (own, namespace, mesh):
        for p in group:
            mode = (p["spec"].get("mtls") or {}).get("mode", "UNSET")
            if mode != "UNSET":
                return mode, f"PeerAuthentication/{_name(p)}"
    return "PERMISSIVE", "Istio's default: no PeerAuthentication here says otherwise"


def check_authorization(objects: list[Obj]) -> list[str]:
    """Warnings, each `AuthorizationPolicy/name: ...` (the policy that selects the workload)."""
    warnings = []
    # Sidecar policies only: not CUSTOM (provider) ones, nor those bound to a waypoint or gateway.
    allow = [p for p in _of(objects, "AuthorizationPolicy") if p["spec"].get("action", "ALLOW") == "ALLOW"
             and not p["spec"].get("provider") and not p["spec"].get("targetRef") and not p["spec"].get("targetRefs")]
    for w in _workloads(objects):
        policies = [p for p in allow if _applies(p, w)]
        if not policies or not injected(w):  # no sidecar: no policy is enforced there
            continue
        where, what = f"AuthorizationPolicy/{_name(policies[0])}", f"{w['kind']}/{_name(w)}"
        rules = [r for p in policies for r in p["spec"].get("rules") or []]
        for c in w["spec"]["template"]["spec"]["containers"]:
            for port_spec in c.get("ports", []):
                port = int(port_spec["containerPort"])
                label = f"port {port}" + (f" ({port_spec['name']})" if port_spec.get("name") else "")
                admitting = [r for r in rules if _admits(r, port)]
                if not admitting:
                    warnings.append(f"{where}: {label} of {what} is in no rule, so every request to it is denied "
                                    "(403; e.g. Prometheus scraping it): add a rule for it (meshcache's render "
                                    "admits every port but the inference ones from any caller)")
                    continue
                if not all(_needs_identity(r) for r in admitting):
                    continue
                mode, source = mtls_mode(objects, w, port)
                if mode != "STRICT":
                    warnings.append(f"{where}: {label} of {what} admits only callers with a mesh identity, but "
                                    f"its mTLS is {mode} ({source}): plaintext callers (no sidecar) get through mTLS "
                                    "and are denied (403); mesh them, make it STRICT (or pass your mesh-wide STRICT "
                                    "PeerAuthentication with --workload), or render with --authz none")
    return warnings
