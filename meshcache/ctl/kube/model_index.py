"""The model index of a kube mesh's engine pods, for `meshcache policy set`'s typo warning.

The control plane of `up --kube` runs on the host and cannot read the engines itself: their
REST port is behind their sidecar (STRICT mTLS, and an AuthorizationPolicy for the mesh's
callers). The CLI reads each engine pod's KServe repository index from inside the pod's network
namespace (127.0.0.1, where the sidecar does not intercept; root, as the kube mesh itself), the
pods being those `up --kube` recorded (`engine_netns`), and applies the control plane's own rule
(control_plane/model_index.py prefix_warnings). Bounded: MAX_ENGINES pods, TIMEOUT_S each,
MAX_INDEX_BYTES read.
"""

from __future__ import annotations

import json
import subprocess
import sys

from meshcache.contract.extensions import HTTP_PORT
from meshcache.control_plane.model_index import MAX_ENGINES, MAX_INDEX_BYTES, index_names, prefix_warnings

TIMEOUT_S = 5.0
# Run by the host's Python inside the pod's network namespace: the index, at most MAX bytes.
_SCRIPT = ("import sys,urllib.request as u;r=u.urlopen(u.Request('http://127.0.0.1:{port}/v2/repository/index',"
           "data=b'{{}}',headers={{'content-type':'application/json'}}),timeout={timeout});"
           "sys.stdout.write(r.read({limit}).decode())")


def engine_models(engine_netns: dict[str, str], port: int = HTTP_PORT) -> tuple[set[str], list[str]]:
    """Every model name the engine pods serve, and why a pod could not be read."""
    names: set[str] = set()
    errors: list[str] = []
    script = _SCRIPT.format(port=port, timeout=TIMEOUT_S, limit=MAX_INDEX_BYTES + 1)
    for pod, netns in sorted(engine_netns.items())[:MAX_ENGINES]:
        try:
            out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", script],
                                 capture_output=True, text=True, timeout=TIMEOUT_S + 5)
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"{pod}: {type(exc).__name__}")
            continue
        if out.returncode != 0:
            errors.append(f"{pod}: " + (out.stderr.strip().splitlines() or ["failed"])[-1])
        elif len(out.stdout) > MAX_INDEX_BYTES:
            errors.append(f"{pod}: index larger than {MAX_INDEX_BYTES} bytes")
        else:
            try:
                names |= index_names(pod, json.loads(out.stdout))
            except ValueError as exc:
                errors.append(str(exc))
    return names, errors


def typo_warnings(endpoints: dict[str, object], model_prefix: str) -> list[str]:
    """prefix_warnings for a kube mesh's engines (none for other meshes: their control plane warns)."""
    netns = endpoints.get("engine_netns")
    if endpoints.get("mode") != "kube" or not isinstance(netns, dict) or not netns:
        return []
    names, errors = engine_models({str(k): str(v) for k, v in netns.items()})
    return prefix_warnings(model_prefix, names, errors)
